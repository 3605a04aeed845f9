//! QUIC transport (in progress).
