//! The client side: the listener, worker threads and client connections ([`server`]),
//! the two request kinds ([`forward`] for absolute-form, [`connect`] for tunnels, both
//! logged through [`access`]), interception ([`intercept`], [`h2server`]), and the
//! [`pipeline`] that takes every request through its policies to `crate::upstream`.
//! [`error`] is the one place that turns failures into the responses sluice makes
//! itself. The request's path through them is drawn in docs/architecture.md.

pub mod access;
pub mod connect;
pub mod error;
pub mod forward;
pub mod h2server;
pub mod headers;
pub mod intercept;
pub(crate) mod lifecycle;
pub mod pipeline;
pub mod response;
pub mod rewind;
pub mod server;
#[cfg(test)]
mod sizes;
pub mod splice;
pub mod upgrade;
