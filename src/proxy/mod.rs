//! The client side: the listener, worker threads and client connections ([`server`]),
//! the two request kinds ([`forward`] for absolute-form, [`connect`] for tunnels, both
//! logged through [`access`]; what a tunnel carries is read by [`sniff`]), interception
//! ([`intercept`], [`h2server`]), and the
//! [`pipeline`] that takes every request through its policies to `crate::upstream`.
//! [`discard`] reads away what a client still sends after its answer.
//! [`error`] is the one place that turns failures into the responses sluice makes
//! itself. The request's path through them is drawn in docs/architecture.md.

pub(crate) mod access;
pub(crate) mod connect;
pub(crate) mod discard;
pub(crate) mod error;
pub(crate) mod forward;
pub(crate) mod h2server;
pub(crate) mod headers;
pub(crate) mod intercept;
pub(crate) mod lifecycle;
pub(crate) mod pipeline;
pub(crate) mod response;
pub(crate) mod rewind;
pub(crate) mod server;
#[cfg(test)]
mod sizes;
pub(crate) mod sniff;
pub(crate) mod splice;
pub(crate) mod upgrade;
