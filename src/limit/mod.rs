//! The limiter.
pub mod bucket;
pub mod kinds;
