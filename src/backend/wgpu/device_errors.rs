//! Device failures as errors: the first failure since the last synchronisation point, returned there.
//!
//! wgpu reports most failures asynchronously: an error outside any error scope goes to the device's
//! uncaptured-error handler (whose default panics), a lost device to its lost callback. The backend
//! installs both to record into [`DeviceErrors`], and ops record their own refusals (a shape past the
//! software loop budget) there too. `synchronize`, `download` and `sum_squares` wait for the work, then
//! return the first recorded error, as a CUDA backend returns the first asynchronous error at its next
//! synchronisation. A lost device stays lost: its error is returned at every later synchronisation.

use super::BackendError;
use std::sync::{Arc, Mutex, PoisonError};

/// The first error recorded since the last synchronisation point; shared with wgpu's callbacks.
#[derive(Clone, Default)]
pub(super) struct DeviceErrors(Arc<Mutex<Option<BackendError>>>);

impl DeviceErrors {
    /// Routes `device`'s uncaptured errors and its loss here.
    pub(super) fn install(&self, device: &wgpu::Device) {
        let errors = self.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| errors.record(from_wgpu(e))));
        let errors = self.clone();
        device.set_device_lost_callback(move |reason, message| {
            errors.record(BackendError::DeviceLost(format!("{reason:?}: {message}")));
        });
    }

    /// Keeps `error` unless an earlier one is pending.
    pub(super) fn record(&self, error: BackendError) {
        let mut first = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        first.get_or_insert(error);
    }

    /// The pending error, if any; cleared unless the device was lost.
    pub(super) fn take(&self) -> Result<(), BackendError> {
        let mut first = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match first.take() {
            None => Ok(()),
            Some(lost @ BackendError::DeviceLost(_)) => {
                *first = Some(lost.clone());
                Err(lost)
            }
            Some(e) => Err(e),
        }
    }
}

/// A wgpu error as a backend error.
pub(super) fn from_wgpu(e: wgpu::Error) -> BackendError {
    match e {
        wgpu::Error::OutOfMemory { .. } => BackendError::OutOfMemory {
            what: "a buffer or command on the device".into(),
            bytes: None,
        },
        wgpu::Error::Validation { description, .. } => BackendError::Driver(format!("wgpu validation: {description}")),
        wgpu::Error::Internal { description, .. } => {
            BackendError::Driver(format!("wgpu internal error: {description}"))
        }
    }
}
