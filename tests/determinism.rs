//! The CPU backend gives the same bits whatever the thread count: every parallel split is over independent
//! outputs and every sum has a fixed order. Five training steps on 1, 2 and 3 threads must agree exactly.

use ringtrain::backend::cpu::CpuBackend;
use ringtrain::collective::mem::single_rank as solo;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer};

fn train_on(threads: usize) -> (Vec<f64>, String) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let cfg = ModelConfig {
            n_layer: 2,
            n_embd: 48,
            n_head: 3,
            vocab_size: 256,
            n_positions: 40,
        };
        let opts = TrainOptions {
            batch_size: 3,
            seq_len: 37,
            ..TrainOptions::for_model(&cfg).with_steps(5)
        };
        let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
        let mut t = Trainer::new(CpuBackend::<f32>::new(), ModelSource::Fresh(cfg), data, opts, solo()).unwrap();
        let losses = (0..5).map(|_| t.train_step().unwrap().loss).collect();
        (losses, t.param_hash().unwrap())
    })
}

#[test]
fn same_bits_on_any_thread_count() {
    let one = train_on(1);
    assert_eq!(one, train_on(2), "1 vs 2 threads");
    assert_eq!(one, train_on(3), "1 vs 3 threads");
    assert_eq!(one, train_on(1), "run to run");
}
