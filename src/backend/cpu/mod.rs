//! CPU reference backend (in progress).
