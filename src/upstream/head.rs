//! The head of a request as its attempts send it: kept by the pipeline for the next
//! attempt, lent to each.

use http::{HeaderMap, Method, Request, Uri, Version};

/// What every attempt of a request sends, kept by the pipeline so that it can be sent
/// again.
#[derive(Default)]
pub(crate) struct RequestHead {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) version: Version,
    pub(crate) headers: HeaderMap,
}

impl RequestHead {
    pub(crate) fn from_parts(parts: http::request::Parts) -> RequestHead {
        RequestHead {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
        }
    }
}

/// One attempt's head, lent by the request, which keeps it for the next attempt. A
/// plain-HTTP connection of the client's own encodes it where it lies, so that a
/// retryable request is never copied; a client that takes the request whole (hyper's,
/// for TLS) gets a copy, or the head itself when `last` (no attempt follows).
pub(crate) struct AttemptHead<'a> {
    pub(crate) head: &'a mut RequestHead,
    pub(crate) last: bool,
}

impl AttemptHead<'_> {
    /// The request, with the head moved out when this is the last attempt, else copied.
    pub(crate) fn into_request<B>(self, body: B) -> Request<B> {
        let head = if self.last {
            std::mem::take(self.head)
        } else {
            let h = &*self.head;
            RequestHead {
                method: h.method.clone(),
                uri: h.uri.clone(),
                version: h.version,
                headers: h.headers.clone(),
            }
        };
        let mut r = Request::new(body);
        *r.method_mut() = head.method;
        *r.uri_mut() = head.uri;
        *r.version_mut() = head.version;
        *r.headers_mut() = head.headers;
        r
    }
}
