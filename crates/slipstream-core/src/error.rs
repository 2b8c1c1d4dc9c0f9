//! The node's error kinds. Each variant has a stable `kind()` string that
//! clients can match on; the mapping to HTTP status lives in one place,
//! [`NodeError::http_status`], used only by the HTTP edge.

use slipstream_shm::ShmError;

/// Why a request (or an operation on the node) failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The request is malformed (400).
    #[error("malformed request: {0}")]
    BadRequest(String),
    /// Its inputs do not fit the pipeline (400).
    #[error("{0}")]
    BadInput(String),
    /// No pipeline has this name (404).
    #[error("unknown pipeline '{0}'")]
    UnknownPipeline(String),
    /// No route, or no object, of this name (404).
    #[error("no route for {0}")]
    NotFound(String),
    /// The route exists for another method (405).
    #[error("method {0} not allowed here")]
    MethodNotAllowed(String),
    /// The body is over the node's limit (413).
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// A component raised on the request's batch (500).
    #[error("component '{stage}' raised: {message}")]
    Component {
        /// The stage.
        stage: String,
        /// What it raised.
        message: String,
    },
    /// No replica of a stage can take the request (503).
    #[error("stage '{stage}' is unavailable: {reason}")]
    Unavailable {
        /// The stage.
        stage: String,
        /// Why.
        reason: String,
    },
    /// The request timeout passed (504).
    #[error("request did not finish within {ms} ms")]
    Timeout {
        /// The timeout, ms.
        ms: u64,
    },
    /// Refused at admission: predicted to miss its deadline (429).
    #[error("refused: predicted to miss its {budget_ms} ms deadline by {over_ms} ms (the pipeline is at capacity)")]
    Overloaded {
        /// Its deadline budget, ms.
        budget_ms: u64,
        /// By how much it would miss, ms.
        over_ms: u64,
    },
    /// Its deadline passed inside the pipeline (504).
    #[error("dropped: its deadline passed while it waited at stage '{stage}'")]
    DeadlineExceeded {
        /// Where it was.
        stage: String,
    },
    /// The node is draining (503).
    #[error("the node is shutting down")]
    ShuttingDown,
    /// The client went away (never sent; 499 in the books).
    #[error("the client went away before the answer")]
    Cancelled,
    /// No stage of this name (404).
    #[error("pipeline '{pipeline}' has no stage '{stage}' (stages: {known})")]
    UnknownStage {
        /// The pipeline.
        pipeline: String,
        /// The name asked for.
        stage: String,
        /// Its stages' names.
        known: String,
    },
    /// An admin route without (or with a wrong) token (401).
    #[error("{0}")]
    Unauthorized(String),
    /// An admin route this listener does not allow (403).
    #[error("{0}")]
    Forbidden(String),
    /// Shared memory failed (503 when full, else 500).
    #[error("shared memory: {0}")]
    Arena(#[from] ShmError),
    /// A bug or an impossible state (500).
    #[error("internal error: {0}")]
    Internal(String),
    /// The object store refused or failed (its own status).
    #[error(transparent)]
    Store(#[from] slipstream_store::StoreError),
}

impl NodeError {
    /// The stable name of the error's kind (`kind` in error bodies).
    pub fn kind(&self) -> &'static str {
        match self {
            NodeError::BadRequest(_) => "bad_request",
            NodeError::BadInput(_) => "bad_input",
            NodeError::UnknownPipeline(_) => "unknown_pipeline",
            NodeError::NotFound(_) => "not_found",
            NodeError::MethodNotAllowed(_) => "method_not_allowed",
            NodeError::PayloadTooLarge { .. } => "payload_too_large",
            NodeError::Component { .. } => "component_error",
            NodeError::Unavailable { .. } => "unavailable",
            NodeError::Timeout { .. } => "timeout",
            NodeError::Overloaded { .. } => "overloaded",
            NodeError::DeadlineExceeded { .. } => "deadline_exceeded",
            NodeError::ShuttingDown => "shutting_down",
            NodeError::Cancelled => "cancelled",
            NodeError::UnknownStage { .. } => "unknown_stage",
            NodeError::Unauthorized(_) => "unauthorized",
            NodeError::Forbidden(_) => "forbidden",
            NodeError::Arena(e) => e.kind(),
            NodeError::Internal(_) => "internal",
            NodeError::Store(e) => e.kind(),
        }
    }

    /// The same error again (for each request of a batch that failed as a
    /// whole). Shared-memory errors other than a full pool, which carry an
    /// OS error, come back as `Internal` with the same message.
    pub fn duplicate(&self) -> NodeError {
        use NodeError as E;
        match self {
            E::BadRequest(m) => E::BadRequest(m.clone()),
            E::BadInput(m) => E::BadInput(m.clone()),
            E::UnknownPipeline(m) => E::UnknownPipeline(m.clone()),
            E::NotFound(m) => E::NotFound(m.clone()),
            E::MethodNotAllowed(m) => E::MethodNotAllowed(m.clone()),
            E::PayloadTooLarge { limit } => E::PayloadTooLarge { limit: *limit },
            E::Component { stage, message } => E::Component { stage: stage.clone(), message: message.clone() },
            E::Unavailable { stage, reason } => E::Unavailable { stage: stage.clone(), reason: reason.clone() },
            E::Timeout { ms } => E::Timeout { ms: *ms },
            E::Overloaded { budget_ms, over_ms } => E::Overloaded { budget_ms: *budget_ms, over_ms: *over_ms },
            E::DeadlineExceeded { stage } => E::DeadlineExceeded { stage: stage.clone() },
            E::ShuttingDown => E::ShuttingDown,
            E::Cancelled => E::Cancelled,
            E::UnknownStage { pipeline, stage, known } => {
                E::UnknownStage { pipeline: pipeline.clone(), stage: stage.clone(), known: known.clone() }
            }
            E::Unauthorized(m) => E::Unauthorized(m.clone()),
            E::Forbidden(m) => E::Forbidden(m.clone()),
            E::Arena(ShmError::Full { requested, capacity }) => {
                E::Arena(ShmError::Full { requested: *requested, capacity: *capacity })
            }
            E::Arena(e) => E::Internal(format!("shared memory: {e}")),
            E::Internal(m) => E::Internal(m.clone()),
            E::Store(e) => E::Store(e.clone()),
        }
    }

    /// How long a client should wait before retrying, ms, for 429 and 503.
    /// A refusal's wait is the predicted drain time: by how much the
    /// request would have missed its deadline, that is how long until the
    /// queues ahead of it have drained enough for it to make one (at least
    /// a millisecond); unavailability asks for a second.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            NodeError::Overloaded { over_ms, .. } => Some((*over_ms).max(1)),
            e if e.http_status() == 503 => Some(1000),
            _ => None,
        }
    }

    /// [`NodeError::retry_after_ms`] in whole seconds, rounded up, for
    /// HTTP's `Retry-After` (which has no finer unit).
    pub fn retry_after_s(&self) -> Option<u64> {
        self.retry_after_ms().map(|ms| ms.div_ceil(1000))
    }

    /// The one place where error kinds become HTTP statuses.
    pub fn http_status(&self) -> u16 {
        match self {
            NodeError::BadRequest(_) | NodeError::BadInput(_) => 400,
            NodeError::Unauthorized(_) => 401,
            NodeError::Forbidden(_) => 403,
            NodeError::UnknownPipeline(_) | NodeError::NotFound(_) | NodeError::UnknownStage { .. } => 404,
            NodeError::MethodNotAllowed(_) => 405,
            NodeError::PayloadTooLarge { .. } => 413,
            NodeError::Component { .. } | NodeError::Internal(_) => 500,
            NodeError::Unavailable { .. } | NodeError::ShuttingDown => 503,
            NodeError::Arena(ShmError::Full { .. }) => 503,
            NodeError::Arena(_) => 500,
            NodeError::Timeout { .. } | NodeError::DeadlineExceeded { .. } => 504,
            NodeError::Overloaded { .. } => 429,
            // nginx's "client closed request": never sent (nobody is
            // listening), but it keeps the kind out of the 5xx family.
            NodeError::Cancelled => 499,
            NodeError::Store(e) => {
                use slipstream_store::StoreError as S;
                match e {
                    S::BadRequest(_) => 400,
                    S::NotFound(_) => 404,
                    S::Conflict { .. } => 409,
                    S::Gone { .. } => 410,
                    S::TooLarge { .. } => 413,
                    S::InUse(_) | S::Io(_) | S::Closed | S::Elsewhere { .. } => 503,
                }
            }
        }
    }
}
