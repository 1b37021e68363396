//! Why a request is not admitted: the limiter's answers that become sluice's own 429
//! and 503 responses.

use std::time::Duration;

use super::bucket::Reject;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("the queue for this bucket is full")]
    QueueFull { retry_after: Duration },
    #[error("admission would take longer than max_wait")]
    QueueTimeout { retry_after: Duration },
    #[error("sluice is shutting down and the drain time ran out before admission")]
    ShuttingDown,
    #[error(
        "the upstream has max_partitions live partitions: a new key value must wait for one to be dropped"
    )]
    PartitionLimit { retry_after: Duration },
    #[error("the Redis that holds the shared limits cannot be reached (on_redis_error = \"deny\")")]
    ClusterUnavailable { retry_after: Duration },
}

impl From<Reject> for LimitError {
    fn from(r: Reject) -> Self {
        match r {
            Reject::QueueFull { retry_after } => LimitError::QueueFull { retry_after },
            Reject::QueueTimeout { retry_after } => LimitError::QueueTimeout { retry_after },
        }
    }
}
