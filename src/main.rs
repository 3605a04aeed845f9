//! The `ringtrain` command line. Its flags are stable: outside scripts depend on them.

mod cli;

use clap::{Parser, Subcommand};
use cli::{
    args::TrainArgs, bench_allreduce, bench_kernels, eval, info, launch, plot, sample, selftest, tokenize, train,
};
use ringtrain::collective::shm::LinkTransport;
use ringtrain::collective::{CollectiveChoice, Wire};
use std::path::PathBuf;
use std::process::ExitCode;

// mimalloc keeps freed memory mapped for reuse; glibc's malloc returned the per-message buffers of the
// collective layer to the kernel and faulted them back in. A 64 MiB all-reduce took less CPU with mimalloc
// (BENCHMARKS.md, "Transport settings", has the before/after).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "ringtrain", version, about = "Data-parallel GPT-2 trainer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (one rank; several when launched with RANK/WORLD_SIZE or the flags)
    Train(Box<TrainArgs>),
    /// Start N local training processes that train data-parallel over QUIC on loopback
    Launch {
        #[arg(long)]
        nproc: usize,
        #[arg(long)]
        master_port: Option<u16>,
        /// With `--elastic` among the train flags: restart a rank that failed, up to this many times per
        /// rank, as a member asking to rejoin the running job
        #[arg(long, default_value_t = 0)]
        max_restarts: usize,
        /// `train` and its flags, after `--`
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Generate text from a checkpoint
    Sample {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long, default_value = "")]
        prompt: String,
        #[arg(long, default_value_t = 200)]
        tokens: usize,
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Keep the K most likely tokens (0: all)
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 1337)]
        seed: u64,
    },
    /// Mean loss and perplexity of a checkpoint on a corpus
    Eval {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        data: String,
        #[arg(long, default_value_t = 4)]
        batch_size: usize,
        #[arg(long)]
        seq_len: Option<usize>,
        /// At most this many batches
        #[arg(long, default_value_t = 50)]
        batches: usize,
        /// Also write the first batch's inputs and logits (safetensors) for scripts/hf_check.py
        #[arg(long)]
        dump_logits: Option<PathBuf>,
    },
    /// Benchmarks
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Plot loss and throughput from a metrics file
    Plot {
        metrics: PathBuf,
        #[arg(short = 'o', long = "output", default_value = "loss.png")]
        output: PathBuf,
    },
    /// Backends and adapters found, and why others are missing
    Info,
    /// Check every op of one backend against the CPU reference (one row per case; exit status 1 if any fails)
    Selftest {
        /// auto, cpu, wgpu or cuda
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Also write the results to this JSON file
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Tokenize text or JSONL files into llm.c shards (first shard validation, the rest training)
    Tokenize {
        /// Text files (each file one document) or `.jsonl` files (one document per line)
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Output directory (created if missing; must not already hold .bin files)
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
        /// The JSONL field holding each document's text
        #[arg(long, default_value = "text")]
        field: String,
        /// Tokens per shard; shard 0 is validation
        #[arg(long, default_value_t = ringtrain::data::pretokenize::DEFAULT_SHARD_TOKENS)]
        shard_tokens: u64,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Matmul GFLOP/s and elementwise bandwidth of one backend, with a native-loop reference
    Kernels {
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Square matmul sizes, comma-separated
        #[arg(long, value_delimiter = ',', default_value = "512,1024")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
    /// All-reduce bandwidth between N local processes, over shared memory or QUIC (nccl-tests style table)
    Allreduce {
        #[arg(long, default_value_t = 2)]
        nproc: usize,
        /// Comma-separated message sizes (B, KiB, MiB, GiB)
        #[arg(long, default_value = "1MiB,16MiB,64MiB")]
        size: String,
        #[arg(long, default_value_t = 10)]
        iters: usize,
        /// Ring links between the processes: auto (shared memory), shm, or quic
        #[arg(long, value_enum, default_value_t = LinkTransport::Auto)]
        transport: LinkTransport,
        /// The flat ring, the two-level one (needs several hosts), or auto
        #[arg(long, value_enum, default_value_t = CollectiveChoice::Auto)]
        collective: CollectiveChoice,
        /// Emulated hosts the local processes are spread over (contiguous blocks of ranks, each block with
        /// its own RINGTRAIN_HOST_ID), so that a two-level ring can be measured on one machine
        #[arg(long, default_value_t = 1)]
        hosts: usize,
        /// What the reduced values travel in (as train's --wire)
        #[arg(long, value_enum, default_value_t = Wire::F32)]
        wire: Wire,
    },
    /// ms/step, tokens/s and GFLOP/s of training steps (takes the train flags; --steps = timed steps)
    Step {
        #[command(flatten)]
        args: Box<TrainArgs>,
        /// Untimed steps first
        #[arg(long, default_value_t = 2)]
        warmup_steps: u64,
        /// Also time and count every op of the timed steps, by op family (one synchronisation after each
        /// op): a table on stderr, and `profile` in the JSON line
        #[arg(long)]
        profile: bool,
    },
}

/// `RUST_LOG` when set; otherwise ringtrain's own warnings (refused peers, a rendezvous still waiting,
/// checkpoint clean-up failures) and every crate's errors, so what a user must see is never hidden behind a
/// variable, while the GPU drivers' chatter stays out.
fn log_filter() -> tracing_subscriber::EnvFilter {
    match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => tracing_subscriber::EnvFilter::new(directives),
        _ => tracing_subscriber::EnvFilter::new("error,ringtrain=warn"),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train::run_train(*args),
        Command::Launch {
            nproc,
            master_port,
            max_restarts,
            command,
        } => launch::run_launch(nproc, master_port, max_restarts, &command),
        Command::Sample {
            checkpoint,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
        } => sample::run_sample(
            &checkpoint,
            &sample::SampleOptions {
                prompt,
                tokens,
                temperature,
                top_k,
                seed,
            },
        ),
        Command::Eval {
            checkpoint,
            data,
            batch_size,
            seq_len,
            batches,
            dump_logits,
        } => eval::run_eval(
            &checkpoint,
            &data,
            &eval::EvalOptions {
                batch_size,
                seq_len,
                batches,
                dump_logits,
            },
        ),
        Command::Bench(BenchCommand::Step {
            args,
            warmup_steps,
            profile,
        }) => train::run_bench_step(*args, warmup_steps, profile),
        Command::Bench(BenchCommand::Kernels { backend, sizes, iters }) => {
            bench_kernels::run_bench_kernels(&backend, &sizes, iters)
        }
        Command::Bench(BenchCommand::Allreduce {
            nproc,
            size,
            iters,
            transport,
            collective,
            hosts,
            wire,
        }) => bench_allreduce::run_bench_allreduce(&bench_allreduce::BenchAllreduce {
            nproc,
            sizes: size,
            iters,
            transport,
            collective,
            hosts,
            wire,
        }),
        Command::Plot { metrics, output } => plot::plot_file(&metrics, &output),
        Command::Info => info::run_info(),
        Command::Selftest { backend, json } => selftest::run_selftest(&backend, json.as_deref()),
        Command::Tokenize {
            inputs,
            output,
            tokenizer,
            field,
            shard_tokens,
        } => tokenize::run_tokenize(&inputs, &output, &tokenizer, &field, shard_tokens),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One write: under `launch` several ranks share this stderr, and a line written in pieces
            // could interleave with another rank's.
            cli::progress::eprint_line(&format!("error: {e:#}"));
            ExitCode::FAILURE
        }
    }
}
