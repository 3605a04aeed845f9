//! Early read-backs: ordering against the ops around them, several in flight, readiness, reuse of the
//! staging buffers, and errors instead of panics.

use super::{bits, download, values, wgpu_or_skip};
use crate::backend::wgpu::readback::MAX_IN_FLIGHT;
use crate::backend::wgpu::WgpuBackend;
use crate::backend::{Backend, BackendError, Download, View};

/// Smallest buffers `set_max_buffer_bytes` allows, so that the views below straddle segments.
const SMALL_BUFFERS: Option<u64> = Some(1);

fn begin(be: &mut WgpuBackend, v: View) -> Download {
    let d = be.begin_download(v, Vec::new()).unwrap();
    assert!(
        matches!(d, Download::InFlight { .. }),
        "a non-empty view is read back later"
    );
    d
}

fn is_invalid_view(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(BackendError::InvalidView(_)))
}

/// The copy sees every op recorded before `begin_download` and none recorded after, even ones that
/// overwrite the same range before `finish_download`: it equals a plain `download` taken at that point.
#[test]
fn a_read_back_holds_the_values_of_when_it_began() {
    let Some(mut be) = wgpu_or_skip(SMALL_BUFFERS) else {
        return;
    };
    let all = be.alloc(12_000).unwrap();
    let v = all.sub(3, 9_000);
    let x = values(1, v.len);
    let doubled: Vec<f32> = x.iter().map(|a| a * 2.0).collect();
    let at_begin = |be: &mut WgpuBackend| {
        be.upload(v, &x).unwrap();
        // Recorded, not yet submitted, when the read-back begins.
        be.scale(v, 2.0);
    };

    at_begin(&mut be);
    let early = begin(&mut be, v);
    be.fill(v, 7.0);
    be.scale(v, 0.5);
    be.scale(all, 3.0);
    let got = be.finish_download(early).unwrap();
    assert_eq!(bits(&got), bits(&doubled));
    assert_eq!(download(&mut be, v), vec![10.5; v.len], "the later ops ran");

    at_begin(&mut be);
    let plain = download(&mut be, v);
    assert_eq!(bits(&got), bits(&plain), "same as a plain download at that point");
    be.synchronize().unwrap();
}

/// Several read-backs in flight at once, of views at odd offsets (one straddling segments), with ops
/// between their begins, finished in another order: each holds the values of its own begin.
#[test]
fn read_backs_in_flight_together_finish_in_any_order() {
    let Some(mut be) = wgpu_or_skip(SMALL_BUFFERS) else {
        return;
    };
    let all = be.alloc(20_000).unwrap();
    let x = values(2, all.len);
    be.upload(all, &x).unwrap();
    let seg = be.allocation(all.buf).seg;
    let (a, b, c) = (all.sub(5, 3_001), all.sub(seg - 17, 500), all.sub(9_001, 7_777));
    let host = |v: View, data: &[f32]| data[v.offset..v.end()].to_vec();

    let da = begin(&mut be, a);
    be.scale(all, 2.0);
    let db = begin(&mut be, b);
    let doubled: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    be.fill(a, -1.0);
    be.fill(c, 4.0);
    let dc = begin(&mut be, c);
    be.fill(all, 0.0);

    assert_eq!(bits(&be.finish_download(dc).unwrap()), bits(&vec![4.0; c.len]));
    assert_eq!(bits(&be.finish_download(da).unwrap()), bits(&host(a, &x)));
    assert_eq!(bits(&be.finish_download(db).unwrap()), bits(&host(b, &doubled)));
    assert_eq!(download(&mut be, all), vec![0.0; all.len]);
}

/// A view larger than one staging buffer is copied into several under one ticket, in order.
#[test]
fn a_large_view_is_read_back_in_several_staging_buffers() {
    let Some(mut be) = wgpu_or_skip(SMALL_BUFFERS) else {
        return;
    };
    be.set_max_staging_bytes(4_000);
    let all = be.alloc(12_000).unwrap();
    let v = all.sub(1, 11_000);
    let x = values(3, v.len);
    be.upload(v, &x).unwrap();
    let d = begin(&mut be, v);
    be.fill(all, 1.0);
    assert_eq!(bits(&be.finish_download(d).unwrap()), bits(&x));
    let d = begin(&mut be, v);
    be.synchronize().unwrap();
    assert_eq!(be.readbacks.pooled(), 0, "11 staging buffers in flight");
    be.finish_download(d).unwrap();
    assert_eq!(be.readbacks.pooled(), 11, "44 000 bytes in buffers of 4 000");
    assert_eq!(
        download(&mut be, v),
        vec![1.0; v.len],
        "the plain download in rounds too"
    );
}

/// After a `synchronize` the read-back has arrived: `download_ready` says so, and finishing does not wait.
#[test]
fn a_read_back_is_ready_after_synchronize() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let v = be.alloc(1_000).unwrap();
    let x = values(4, v.len);
    be.upload(v, &x).unwrap();
    let d = begin(&mut be, v);
    be.scale(v, 2.0);
    be.synchronize().unwrap();
    assert!(be.download_ready(&d).unwrap());
    assert_eq!(bits(&be.finish_download(d).unwrap()), bits(&x));

    // Polled without a synchronize, it arrives too.
    let d = begin(&mut be, v);
    let mut polls = 0;
    while !be.download_ready(&d).unwrap() {
        polls += 1;
        assert!(polls < 10_000, "never ready");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let doubled: Vec<f32> = x.iter().map(|a| a * 2.0).collect();
    assert_eq!(bits(&be.finish_download(d).unwrap()), bits(&doubled));

    // An empty view needs no copy.
    let empty = be.begin_download(v.sub(10, 0), vec![1.0; 3]).unwrap();
    assert!(be.download_ready(&empty).unwrap());
    assert_eq!(be.finish_download(empty).unwrap(), Vec::<f32>::new());
}

/// A ticket the backend does not hold (made up, finished already, or reclaimed) is an error, not a panic.
#[test]
fn an_unknown_ticket_is_an_error() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let made_up = Download::InFlight {
        ticket: 12_345,
        host: vec![0.0; 4],
    };
    assert!(is_invalid_view(&be.download_ready(&made_up).unwrap_err()));
    assert!(is_invalid_view(&be.finish_download(made_up).unwrap_err()));

    let v = be.alloc(8).unwrap();
    let Download::InFlight { ticket, .. } = begin(&mut be, v) else {
        unreachable!()
    };
    let again = || Download::InFlight {
        ticket,
        host: Vec::new(),
    };
    assert_eq!(be.finish_download(again()).unwrap(), vec![0.0; 8]);
    let err = be.finish_download(again()).unwrap_err();
    assert!(is_invalid_view(&err), "{err:#}");
    assert!(err.to_string().contains(&format!("#{ticket}")), "{err:#}");
    be.synchronize().unwrap();
}

/// A device error recorded before `finish_download` is returned by it, once; the backend works on.
#[test]
fn a_device_error_reaches_finish_download() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let v = be.alloc(5).unwrap();
    be.upload(v, &[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let d = begin(&mut be, v);
    // MAP_READ combines only with COPY_DST without MAPPABLE_PRIMARY_BUFFERS, which the device lacks.
    let _invalid = be.ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid on purpose"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let err = be.finish_download(d).unwrap_err();
    assert!(matches!(err.downcast_ref(), Some(BackendError::Driver(_))), "{err:#}");
    be.synchronize().expect("reported once");
    let d = begin(&mut be, v);
    assert_eq!(be.finish_download(d).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
}

/// Staging buffers are reused from step to step; a read-back dropped unfinished is reclaimed by the second
/// `synchronize` after its begin (finishing it then is an error), and unused pooled buffers are freed.
#[test]
fn staging_buffers_are_pooled_and_unfinished_read_backs_reclaimed() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let all = be.alloc(3_000).unwrap();
    let buckets = [all.sub(0, 1_000), all.sub(1_000, 1_000), all.sub(2_000, 999)];
    for step in 0..3 {
        be.fill(all, step as f32);
        let ds: Vec<Download> = buckets.iter().map(|&b| begin(&mut be, b)).collect();
        let pooled = be.readbacks.pooled();
        assert_eq!(pooled, 0, "step {step}: every pooled buffer is taken again");
        for (d, b) in ds.into_iter().zip(buckets) {
            assert_eq!(be.finish_download(d).unwrap(), vec![step as f32; b.len]);
        }
        assert_eq!(be.readbacks.pooled(), 3);
        be.synchronize().unwrap();
    }

    let kept = begin(&mut be, buckets[0]);
    drop(begin(&mut be, buckets[1]));
    be.synchronize().unwrap();
    assert_eq!(be.readbacks.in_flight(), 2, "a read-back survives one synchronize");
    be.synchronize().unwrap();
    assert_eq!(be.readbacks.in_flight(), 0, "and is reclaimed at the second");
    assert_eq!(
        be.readbacks.pooled(),
        2,
        "its staging buffer back in the pool; the unused one freed"
    );
    let err = be.finish_download(kept).unwrap_err();
    assert!(is_invalid_view(&err), "{err:#}");
    be.synchronize().unwrap();
    assert_eq!(
        be.readbacks.pooled(),
        0,
        "pooled buffers unused for a whole interval are freed"
    );
}

/// Without any `synchronize`, unfinished read-backs past the bound reclaim the oldest: dropping them
/// forever holds a bounded number.
#[test]
fn dropped_read_backs_stay_bounded_without_synchronize() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let v = be.alloc(8).unwrap();
    let first = begin(&mut be, v);
    for _ in 0..MAX_IN_FLIGHT + 10 {
        drop(begin(&mut be, v));
    }
    assert_eq!(be.readbacks.in_flight(), MAX_IN_FLIGHT);
    let err = be.finish_download(first).unwrap_err();
    assert!(is_invalid_view(&err), "{err:#}");
    be.synchronize().unwrap();
}

/// A plain `download` (a step's loss, a norm) takes its staging buffer from the pool and gives it back: the
/// same read every step creates no new buffer, and one no read used for a whole interval is freed.
#[test]
fn plain_downloads_reuse_pooled_staging_buffers() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let loss = be.alloc(1).unwrap();
    for step in 0..3 {
        be.fill(loss, step as f32);
        assert_eq!(download(&mut be, loss), vec![step as f32]);
        assert_eq!(
            be.readbacks.pooled(),
            1,
            "step {step}: one staging buffer, taken and given back"
        );
        be.synchronize().unwrap();
    }
    be.synchronize().unwrap();
    be.synchronize().unwrap();
    assert_eq!(be.readbacks.pooled(), 0, "unused for a whole interval: freed");
}
