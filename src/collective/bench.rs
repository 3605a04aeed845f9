//! All-reduce benchmark (in progress).
