//! Freeing and device errors.

use super::{delta, download, wgpu_or_skip};
use crate::backend::wgpu::WgpuBackend;
use crate::backend::{Backend, BackendError};
use crate::model::init::init_params;
use crate::model::{Gpt2, ModelConfig, ParamLayout};

/// Freeing an allocation returns its memory, drops the bind groups that bind it, and never lets its id
/// reach a later buffer: the next allocation gets a new id and new bind groups, and computes right.
#[test]
fn freed_buffers_release_memory_and_bind_groups() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let base = be.allocated_bytes();
    let old = be.alloc(1000).unwrap();
    let tokens = be.alloc_tokens(10).unwrap();
    assert_eq!(be.allocated_bytes(), base + 4000 + 40);
    be.fill(old, 2.0);
    let old_id = be.allocation(old.buf).segs[0].id;
    assert!(be.bind_groups.binds(old_id));
    be.free(old);
    be.free_tokens(tokens);
    assert_eq!(be.allocated_bytes(), base);
    assert!(!be.bind_groups.binds(old_id), "entries of the freed buffer are dropped");
    let new = be.alloc(1000).unwrap();
    assert_ne!(new.buf, old.buf, "ids are never reused");
    assert_ne!(be.allocation(new.buf).segs[0].id, old_id);
    let before = be.bind_group_stats();
    be.fill(new, 3.0);
    let d = delta(before, be.bind_group_stats());
    assert_eq!((d.hits, d.misses), (0, 1), "the new buffer is bound afresh: {d:?}");
    assert_eq!(download(&mut be, new), vec![3.0; 1000]);
    be.synchronize().unwrap();
}

/// A view into a freed buffer, or a second free, is a programming error: a panic, never another buffer.
#[test]
fn views_into_freed_buffers_panic() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let v = be.alloc(8).unwrap();
    be.free(v);
    let stale = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.fill(v, 1.0)));
    assert!(stale.is_err(), "a view into a freed buffer");
    let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.free(v)));
    assert!(twice.is_err(), "a second free");
}

/// A model whose batch shape changes frees the old activations: memory goes back to what the new shape
/// needs, and returning to a shape gives the same memory and the same bits.
#[test]
fn model_frees_activations_when_the_shape_changes() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init_params(&cfg, &layout, 5)).unwrap();
    let batch =
        |b: usize, t: usize| -> Vec<u32> { (0..(b * t) as u32).map(|i| i * 7 % cfg.vocab_size as u32).collect() };
    let mut run = |be: &mut WgpuBackend, b: usize, t: usize| {
        let x = batch(b, t);
        let loss = model.forward(be, &x, &x, b, t).unwrap();
        (loss, be.allocated_bytes())
    };
    let (loss_large, large) = run(&mut be, 2, 16);
    let (_, small) = run(&mut be, 1, 8);
    assert!(small < large, "{small} >= {large}");
    let (again, large_again) = run(&mut be, 2, 16);
    assert_eq!(large_again, large);
    assert_eq!(again.to_bits(), loss_large.to_bits());
}

/// A device error (here a validation error, provoked on purpose) does not panic: it is returned by the
/// next `download`, `sum_squares` or `synchronize`, once, and the backend works on.
#[test]
fn device_errors_reach_the_next_synchronisation_point() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let x = be.alloc(5).unwrap();
    be.upload(x, &[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let provoke = |be: &WgpuBackend| {
        // MAP_READ combines only with COPY_DST without MAPPABLE_PRIMARY_BUFFERS, which the device lacks.
        be.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("invalid on purpose"),
            size: 16,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let is_driver = |e: &anyhow::Error| matches!(e.downcast_ref(), Some(BackendError::Driver(_)));
    let _invalid = provoke(&be);
    let err = be.download(x, &mut [0.0; 5]).expect_err("download reports it");
    assert!(is_driver(&err), "{err:#}");
    let _invalid = provoke(&be);
    let err = be.sum_squares(x).expect_err("sum_squares reports it");
    assert!(is_driver(&err), "{err:#}");
    let _invalid = provoke(&be);
    let err = be.synchronize().expect_err("synchronize reports it");
    assert!(is_driver(&err), "{err:#}");
    be.synchronize().expect("reported once");
    assert_eq!(be.sum_squares(x).unwrap(), 55.0);
}

/// A lost device (destroyed here) is an error at every synchronisation point after it, not a panic.
#[test]
fn a_lost_device_is_an_error() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let x = be.alloc(5).unwrap();
    be.ctx.device.destroy();
    for _ in 0..2 {
        let err = be.synchronize().expect_err("the device is gone");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::DeviceLost(_))),
            "{err:#}"
        );
    }
    let err = be.download(x, &mut [0.0; 5]).expect_err("the device is gone");
    assert!(
        matches!(err.downcast_ref(), Some(BackendError::DeviceLost(_))),
        "{err:#}"
    );
}
