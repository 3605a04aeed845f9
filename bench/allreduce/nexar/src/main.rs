//! nexar ring AllReduce benchmark: N clients in one process (nexar's `bootstrap_local`, QUIC on loopback),
//! f32 sum, same table as `ringtrain bench allreduce`.
//!
//! Usage: ringtrain-bench-nexar NPROC SIZES_BYTES(comma-separated) ITERS

use std::sync::Arc;
use std::time::Instant;

use nexar::{BufferRef, CpuAdapter, DataType, Host, NexarClient, ReduceOp};

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{}MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{}KiB", bytes >> 10)
    } else {
        format!("{bytes}B")
    }
}

#[tokio::main]
async fn main() -> nexar::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args.get(1).map(|s| s.parse().expect("NPROC")).unwrap_or(2);
    let sizes: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').map(|x| x.parse().expect("size in bytes")).collect())
        .unwrap_or(vec![4096, 64 << 20]);
    let iters: usize = args.get(3).map(|s| s.parse().expect("ITERS")).unwrap_or(10);
    let warmup = 2usize;

    let adapter = Arc::new(CpuAdapter::new());
    let clients: Vec<Arc<NexarClient>> = NexarClient::bootstrap_local(n, adapter)
        .await?
        .into_iter()
        .map(Arc::new)
        .collect();

    println!("nexar 0.2.0 all-reduce (f32 sum), {n} tasks in one process, QUIC on loopback");
    println!(
        "{:>10} {:>12} {:>12} {:>12}",
        "size", "time_us", "algbw_GB/s", "busbw_GB/s"
    );
    for &bytes in &sizes {
        let count = bytes / 4;
        let mut handles = Vec::new();
        for c in &clients {
            let c = Arc::clone(c);
            handles.push(tokio::spawn(async move {
                let mut data = vec![c.rank() as f32 + 1.0; count];
                // SAFETY: `buf` addresses `data`'s `count` f32s (count * 4 bytes); `data` is neither moved nor
                // resized while `buf` is used, and both live until the end of this task.
                let mut buf = unsafe { BufferRef::<Host>::new(data.as_mut_ptr() as u64, count * 4) };
                for _ in 0..warmup {
                    c.all_reduce_host(&mut buf, count, DataType::F32, ReduceOp::Sum).await?;
                }
                c.barrier().await?;
                let t = Instant::now();
                for _ in 0..iters {
                    c.all_reduce_host(&mut buf, count, DataType::F32, ReduceOp::Sum).await?;
                }
                let el = t.elapsed().as_secs_f64() / iters as f64;
                drop(buf);
                std::hint::black_box(&data);
                nexar::Result::Ok(el)
            }));
        }
        let mut worst = 0f64;
        for h in handles {
            worst = worst.max(h.await.expect("task")?);
        }
        let algbw = bytes as f64 / worst / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{:>10} {:>12.1} {:>12.3} {:>12.3}",
            human(bytes),
            worst * 1e6,
            algbw,
            busbw
        );
    }
    Ok(())
}
