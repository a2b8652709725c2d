//! `mpirun -np W padfree train` end to end (feature `mpi`; needs Open MPI's
//! `mpirun`): W ranks give one process's losses and weights when it
//! accumulates over the same multipack bins; the same world size twice is
//! byte-identical; resume continues exactly, and on another world size with
//! the same micro-batches per step to f32 rounding, and with another number
//! re-planned; ZeRO stage 1 gives the unsharded run's losses (in f32 and,
//! with the bf16 weight copies, in `--bf16`); the exchange
//! overlapped with the backward pass gives one process's; a rank that dies
//! ends the job.
//!
//! `cargo test -p padfree-cli --features mpi --test mpi_cli`. Launch
//! settings keep the ranks on loopback and off core pinning, and let CI run
//! as root.
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{first_records, padfree, scratch, stderr, tiny_config_with_shipped_vocab};

fn mpirun(ranks: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new("mpirun");
    command
        .args([
            "-np",
            &ranks.to_string(),
            "--bind-to",
            "none",
            "--oversubscribe",
        ])
        .arg(env!("CARGO_BIN_EXE_padfree"))
        .args(args)
        .env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1");
    for (name, value) in env {
        command.env(name, value);
    }
    within_limit(command)
}

/// Runs `command` to its end, or kills it after [`LIMIT`]: a hung job fails
/// the test instead of stalling the suite.
fn within_limit(mut command: Command) -> Output {
    use std::io::Read;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun runs (install openmpi-bin)");
    let mut pipes = (child.stdout.take(), child.stderr.take());
    let readers = [
        pipes.0.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        pipes.1.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .map(|pipe| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                pipe.read_to_end(&mut bytes).ok();
            }
            bytes
        })
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        if started.elapsed() > LIMIT {
            child.kill().ok();
            // mpirun's ranks go with it when it is killed.
            panic!("the job ran over {LIMIT:?}: hung");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let [stdout, stderr] = readers.map(|r| r.join().expect("reader"));
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Longer than any job here needs in a debug build on 2 cores (the longest,
/// 4 ranks for 6 steps, takes about a minute).
const LIMIT: Duration = Duration::from_secs(300);

/// The common flags: a tiny model on 40 shipped records, multipack bins of
/// 600 tokens, 6 steps.
fn run_args(config: &str, data: &str, out: &str, accumulation: usize) -> Vec<String> {
    [
        "train",
        "--config",
        config,
        "--data",
        data,
        "--multipack",
        "--max-tokens-per-batch",
        "600",
        "--max-steps",
        "6",
        "--learning-rate",
        "3e-3",
        "--logging-steps",
        "1",
        "--save-steps",
        "3",
        "--output-dir",
        out,
        "--gradient-accumulation-steps",
        &accumulation.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn setup(dir: &Path) -> (String, String) {
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("train.jsonl");
    std::fs::write(&data, first_records(40)).expect("write data");
    (config, data.display().to_string())
}

fn trainer_state(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("trainer_state.json")).expect("state"))
        .expect("json")
}

fn step_losses(dir: &Path) -> Vec<f64> {
    trainer_state(dir)["step_losses"]
        .as_array()
        .expect("losses")
        .iter()
        .map(|l| l.as_f64().expect("f64"))
        .collect()
}

/// Every tensor of `model.safetensors` as f32 values, by name.
fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    tensors_of(&dir.join("model.safetensors"))
}

/// Every f32 tensor of a safetensors file, by name, sorted.
fn tensors_of(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("safetensors file");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut tensors: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// `||ours - theirs|| / ||theirs||` (L2, f64).
fn relative_l2(ours: &[f32], theirs: &[f32]) -> f64 {
    let norm =
        |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let diff = norm(&mut ours.iter().zip(theirs).map(|(a, b)| a - b));
    diff / norm(&mut theirs.iter().copied()).max(1e-30)
}

fn as_str(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn ranks_match_one_process_and_repeat_bit_identically() {
    let guard = scratch("mpi-equal");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let one = dir.join("one");
    let output = padfree(&as_str(&run_args(
        &config,
        &data,
        &one.display().to_string(),
        4,
    )));
    assert!(output.status.success(), "{}", stderr(&output));
    let reference_losses = step_losses(&one);
    let reference = weights(&one);
    // The ring (the default) and gather-and-add on 4 ranks.
    let runs = [
        (2, 2, "ring"),
        (4, 1, "ring"),
        (4, 1, "gather"),
        (2, 2, "ring"),
    ];
    for (run, (ranks, accumulation, exchange)) in runs.into_iter().enumerate() {
        let out = dir.join(format!("ranks-{ranks}-run-{run}"));
        let mut args = run_args(&config, &data, &out.display().to_string(), accumulation);
        args.extend(["--ddp-exchange".to_owned(), exchange.to_owned()]);
        let output = mpirun(ranks, &as_str(&args), &[]);
        assert!(
            output.status.success(),
            "{ranks} ranks: {}",
            stderr(&output)
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            stdout.contains(&format!("data-parallel: {ranks} ranks over MPI")),
            "{stdout}"
        );
        // Rank 0 alone prints: one summary.
        assert_eq!(
            stdout.matches("***** train metrics *****").count(),
            1,
            "{stdout}"
        );
        let losses = step_losses(&out);
        assert_eq!(losses.len(), 6);
        for (step, (a, b)) in losses.iter().zip(&reference_losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{ranks} ranks, step {}: {a} vs {b}",
                step + 1
            );
        }
        // Relative error of every tensor, ||ours - theirs|| / ||theirs||:
        // only the order of the gradient sums differs (f64 over ranks vs f32
        // over micro-batches), and Adam's normalised update carries it
        // forward. Measured: at most 2e-7 (the largest single element
        // differs by 4e-6 of the tensor's largest value, in the embedding).
        for ((name, ours), (_, theirs)) in weights(&out).iter().zip(&reference) {
            let relative = relative_l2(ours, theirs);
            assert!(
                relative <= 1e-6,
                "{ranks} ranks, {name}: relative {relative:e}"
            );
        }
    }
    // The two 2-rank runs (the first and the last of the loop) wrote the same bytes.
    let mut two_rank_dirs: Vec<_> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("ranks-2-"))
        })
        .collect();
    two_rank_dirs.sort();
    assert_eq!(two_rank_dirs.len(), 2);
    let read = |d: &Path| std::fs::read(d.join("model.safetensors")).expect("model");
    assert!(
        read(&two_rank_dirs[0]) == read(&two_rank_dirs[1]),
        "two 2-rank runs differ"
    );
}

#[test]
fn resume_under_mpi_continues_exactly() {
    let guard = scratch("mpi-resume");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let straight = dir.join("straight");
    let output = mpirun(
        2,
        &as_str(&run_args(
            &config,
            &data,
            &straight.display().to_string(),
            1,
        )),
        &[],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let resumed = dir.join("resumed");
    let checkpoint = straight.join("checkpoint-3").display().to_string();
    let mut args = run_args(&config, &data, &resumed.display().to_string(), 1);
    args.extend(["--resume-from-checkpoint".to_owned(), checkpoint]);
    let output = mpirun(2, &as_str(&args), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        step_losses(&resumed)
            .iter()
            .map(|l| l.to_bits())
            .collect::<Vec<_>>(),
        step_losses(&straight)
            .iter()
            .map(|l| l.to_bits())
            .collect::<Vec<_>>()
    );
    let read = |d: &Path| std::fs::read(d.join("model.safetensors")).expect("model");
    assert!(read(&resumed) == read(&straight), "resumed weights differ");
    // One process, 1 micro-batch per step: the rest of the run is
    // re-planned, and the log says so.
    let one = dir.join("one");
    let mut args = run_args(&config, &data, &one.display().to_string(), 1);
    args.extend([
        "--resume-from-checkpoint".to_owned(),
        straight.join("checkpoint-3").display().to_string(),
    ]);
    let output = padfree(&as_str(&args));
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("planned for the new layout"), "{stdout}");
    let losses = step_losses(&one);
    assert_eq!(losses.len(), 6);
    assert_eq!(losses[..3], step_losses(&straight)[..3]);
    assert_eq!(
        trainer_state(&one)["earlier_layouts"][0]["until_step"].as_u64(),
        Some(3)
    );
}

fn assert_close(ours: &[f64], theirs: &[f64], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}");
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "{what}, step {}: {a} vs {b}",
            step + 1
        );
    }
}

/// ZeRO stage 1 on 2 ranks against the unsharded 2-rank run; its
/// checkpoint holds whole moments; it resumes on 4 ranks x 1 micro-batch,
/// and that run's checkpoint back on 2 ranks x 2 without sharding: every
/// step's loss within 1e-6 of the uninterrupted 2-rank run. A world size
/// that changes the micro-batches per step re-plans the rest of the run.
#[test]
fn sharded_optimizer_and_resume_on_other_world_sizes() {
    let guard = scratch("mpi-zero");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let run = |ranks: usize, accumulation: usize, out: &Path, extra: &[&str]| {
        let mut args = run_args(&config, &data, &out.display().to_string(), accumulation);
        let mut extra = extra.iter();
        while let Some(&flag) = extra.next() {
            let value = (*extra.next().expect("a value")).to_owned();
            // A flag of the common ones takes the new value in place.
            match args.iter().position(|a| a == flag) {
                Some(at) => args[at + 1] = value,
                None => args.extend([flag.to_owned(), value]),
            }
        }
        let output = mpirun(ranks, &as_str(&args), &[]);
        assert!(
            output.status.success(),
            "{ranks} ranks: {}",
            stderr(&output)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let straight = dir.join("straight");
    run(2, 2, &straight, &[]);
    let reference = step_losses(&straight);

    let sharded = dir.join("sharded");
    let stdout = run(2, 2, &sharded, &["--zero-stage", "1"]);
    assert!(stdout.contains("ZeRO stage 1"), "{stdout}");
    assert_close(&step_losses(&sharded), &reference, "ZeRO stage 1");
    // One set of whole moments, named and shaped as without sharding.
    let moments = |d: &Path| tensors_of(&d.join("checkpoint-3").join("optimizer.safetensors"));
    let (ours, theirs) = (moments(&sharded), moments(&straight));
    assert_eq!(ours.len(), theirs.len());
    for ((name, a), (other, b)) in ours.iter().zip(&theirs) {
        assert_eq!((name, a.len()), (other, b.len()));
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5 * scale, "{name}: {worst} of {scale}");
    }

    let four = dir.join("four");
    let from = sharded.join("checkpoint-3").display().to_string();
    let stdout = run(
        4,
        1,
        &four,
        &[
            "--zero-stage",
            "1",
            "--save-steps",
            "1",
            "--resume-from-checkpoint",
            &from,
        ],
    );
    assert!(
        stdout.contains("resuming a run saved as 2 ranks x 2"),
        "{stdout}"
    );
    assert_close(&step_losses(&four), &reference, "2 ranks -> 4");

    let back = dir.join("back");
    let from = four.join("checkpoint-4").display().to_string();
    run(2, 2, &back, &["--resume-from-checkpoint", &from]);
    assert_close(&step_losses(&back), &reference, "4 ranks -> 2");

    // 4 x 2 micro-batches per step: the rest re-planned, the steps taken kept.
    let other = dir.join("other");
    let mut args = run_args(&config, &data, &other.display().to_string(), 2);
    args.extend(["--resume-from-checkpoint".to_owned(), from]);
    let output = mpirun(4, &as_str(&args), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let losses = step_losses(&other);
    assert_eq!(losses.len(), 6);
    assert_eq!(losses[..4], step_losses(&four)[..4]);
}

/// `--bf16` on 2 ranks x 2 micro-batches against one process x 4: every
/// rank writes its bf16 weight copies in its own AdamW update (the whole
/// update, after the all-reduce), and with ZeRO stage 1 each rank updates
/// its shard and remakes the copies after the all-gather. A stale copy
/// (not written, or written from a shard alone) reads last step's weights
/// in the products, and the losses part from one process's (with the
/// update writing no copies, ZeRO's run, which remakes them, parted from
/// the other two at step 2 by 3.5e-3 relative).
#[test]
fn bf16_ranks_match_one_process_with_and_without_zero() {
    let guard = scratch("mpi-bf16");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let args = |out: &Path, accumulation: usize, extra: &[&str]| {
        let mut args = run_args(&config, &data, &out.display().to_string(), accumulation);
        args.push("--bf16".to_owned());
        args.extend(extra.iter().map(|&a| a.to_owned()));
        args
    };
    let one = dir.join("one");
    let output = padfree(&as_str(&args(&one, 4, &[])));
    assert!(output.status.success(), "{}", stderr(&output));
    let reference = step_losses(&one);
    for (name, extra) in [("ddp", &[][..]), ("zero", &["--zero-stage", "1"][..])] {
        let out = dir.join(name);
        let output = mpirun(2, &as_str(&args(&out, 2, extra)), &[]);
        assert!(output.status.success(), "{name}: {}", stderr(&output));
        // Only the order of the gradient sums differs (seen: 2e-6
        // relative, the copies rounding the weights the same but for a few).
        for (step, (a, b)) in step_losses(&out).iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{name}, step {}: {a} vs {b}",
                step + 1
            );
        }
    }
}

/// The exchange overlapped with the recomputed backward pass on 4 ranks:
/// one process's losses and weights (both with per-layer recomputation)
/// within f32 rounding. Without `--gradient-checkpointing` the flag is
/// refused before anything runs.
#[test]
fn the_overlapped_exchange_matches_one_process() {
    let guard = scratch("mpi-overlap");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let one = dir.join("one");
    let mut args = run_args(&config, &data, &one.display().to_string(), 4);
    args.push("--gradient-checkpointing".to_owned());
    let output = padfree(&as_str(&args));
    assert!(output.status.success(), "{}", stderr(&output));

    let out = dir.join("overlapped");
    let mut args = run_args(&config, &data, &out.display().to_string(), 1);
    args.extend(["--gradient-checkpointing", "--ddp-overlap"].map(str::to_owned));
    let output = mpirun(4, &as_str(&args), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("ring exchange overlapped with the backward pass"),
        "{stdout}"
    );
    assert_close(
        &step_losses(&out),
        &step_losses(&one),
        "overlapped, 4 ranks",
    );
    for ((name, ours), (_, theirs)) in weights(&out).iter().zip(&weights(&one)) {
        let relative = relative_l2(ours, theirs);
        assert!(
            relative <= 1e-6,
            "overlapped, {name}: relative {relative:e}"
        );
    }

    let refused = dir.join("refused");
    let mut args = run_args(&config, &data, &refused.display().to_string(), 1);
    args.push("--ddp-overlap".to_owned());
    let output = mpirun(2, &as_str(&args), &[]);
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("--ddp-overlap") && err.contains("HINT: add --gradient-checkpointing"),
        "{err}"
    );
    assert!(!refused.join("model.safetensors").exists());
}

#[test]
fn a_rank_that_dies_ends_the_job_and_keeps_earlier_checkpoints() {
    let guard = scratch("mpi-dies");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let started = Instant::now();
    let output = mpirun(
        2,
        &as_str(&run_args(&config, &data, &out.display().to_string(), 1)),
        &[("PADFREE_FAULT", "1:4")],
    );
    let took = started.elapsed();
    assert!(!output.status.success(), "the job must fail");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(
        stderr(&output).contains("rank 1: PADFREE_FAULT"),
        "{}",
        stderr(&output)
    );
    // mpirun's SIGTERM to rank 0: it says a rank may have died, and where
    // to resume (once only "Ctrl-C or SIGTERM").
    assert!(
        stderr(&output).contains(&format!(
            "Under mpirun this is also how a job ends when one of its ranks died (mpirun's own message names it): the step cannot finish then; resume with --resume-from-checkpoint {}",
            out.join("checkpoint-3").display()
        )),
        "{}",
        stderr(&output)
    );
    // checkpoint-3 was complete before rank 1 died, and still loads.
    let checkpoint = out.join("checkpoint-3");
    assert_eq!(step_losses(&checkpoint).len(), 3);
    assert!(!weights(&checkpoint).is_empty());
    assert!(
        !out.join("model.safetensors").exists(),
        "no final model from a failed job"
    );
}

/// `mpirun` with one app context per rank: rank r runs `padfree` with
/// `per_rank[r]`.
fn mpirun_each(per_rank: &[Vec<String>]) -> Output {
    let mut command = Command::new("mpirun");
    command.args(["--bind-to", "none", "--oversubscribe"]);
    for (rank, args) in per_rank.iter().enumerate() {
        if rank > 0 {
            command.arg(":");
        }
        command
            .args(["-np", "1"])
            .arg(env!("CARGO_BIN_EXE_padfree"))
            .args(args);
    }
    command
        .env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1");
    within_limit(command)
}

#[test]
fn bad_data_that_only_one_rank_reads_ends_the_job_with_its_file_and_line() {
    let guard = scratch("mpi-bad-data");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let bad = dir.join("bad.jsonl");
    let mut text = first_records(40);
    text.push_str("{\"question\": \"unfinished\n");
    std::fs::write(&bad, text).expect("write bad data");
    let out = dir.join("run").display().to_string();
    let started = Instant::now();
    let output = mpirun_each(&[
        run_args(&config, &data, &out, 1),
        run_args(&config, &bad.display().to_string(), &out, 1),
    ]);
    let took = started.elapsed();
    assert!(!output.status.success(), "the job must fail");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let message = stderr(&output);
    assert!(message.contains("bad.jsonl:line 41"), "{message}");
    assert!(!dir.join("run").join("model.safetensors").exists());
}

#[test]
fn ranks_that_read_different_data_are_refused_before_training() {
    let guard = scratch("mpi-other-data");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let other = dir.join("other.jsonl");
    std::fs::write(&other, first_records(39)).expect("write other data");
    let out = dir.join("run").display().to_string();
    let output = mpirun_each(&[
        run_args(&config, &data, &out, 1),
        run_args(&config, &other.display().to_string(), &out, 1),
    ]);
    assert!(!output.status.success(), "the job must fail");
    let message = stderr(&output);
    assert!(
        message.contains("the ranks disagree on training data: rank(s) 1"),
        "{message}"
    );
    assert!(!String::from_utf8_lossy(&output.stdout).contains("train metrics"));
}

#[test]
fn bench_compares_ranks_with_one_process_on_the_same_bins() {
    let guard = scratch("mpi-bench");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("bench");
    let mut command = Command::new(env!("CARGO_BIN_EXE_padfree"));
    command
        .args([
            "bench",
            "--config",
            &config,
            "--data",
            &data,
            "--modes",
            "varlen-multipack,varlen-multipack-2ranks",
        ])
        .args(common::QUICK_BENCH)
        .args(["--threads", "2", "--output-dir", &out.display().to_string()])
        .env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let output = within_limit(command);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "padfree, padding-free, multipack bins, 2 MPI ranks",
        "2 MPI ranks of 1 thread vs 1 process of 2 threads on the same multipack bins",
    ] {
        assert!(stdout.contains(expected), "`{expected}` missing:\n{stdout}");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).expect("json"))
            .expect("valid json");
    let results = report["results"].as_array().expect("results");
    let (one, ranks) = (&results[0], &results[1]);
    assert_eq!(ranks["mode"], "varlen-multipack-2ranks");
    // Both rows train 2 bins per step: one process accumulates, the ranks
    // take one each; the step figures are the job's.
    assert_eq!(one["real_tokens"], ranks["real_tokens"]);
    assert_eq!(one["samples"], ranks["samples"]);
    let losses = |r: &serde_json::Value| -> Vec<f64> {
        r["step_losses"]
            .as_array()
            .expect("losses")
            .iter()
            .map(|l| l.as_f64().expect("f64"))
            .collect()
    };
    assert_eq!(losses(one).len(), 3);
    for (a, b) in losses(ranks).iter().zip(losses(one)) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
}

/// LoRA under MPI (dropout on): only the adapters' gradients cross ranks,
/// and 2 ranks train the adapters one process trains with 2 accumulated
/// micro-batches (dropout masks follow the micro-batch's examples, not its
/// rank): the same step losses (1e-6 relative) and adapter tensors (2e-6 of
/// each tensor's norm, the bound of the full-model test above); with the
/// adapters' moments sharded (ZeRO stage 1), and with each layer's adapters
/// exchanged under the recomputed backward pass (`--ddp-overlap`), the same
/// losses; and the same eval losses, the held-out set split over the ranks.
#[test]
fn lora_ranks_match_one_process() {
    let guard = scratch("mpi-lora");
    let dir = guard.path();
    let (config, data) = setup(dir);
    // Held-out records evaluated every 3 steps, split over the ranks.
    let eval = dir.join("eval.jsonl");
    std::fs::write(
        &eval,
        first_records(48)
            .lines()
            .skip(40)
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .expect("write eval data");
    let args = |out: &Path, accumulation: usize| {
        let mut args = run_args(&config, &data, &out.display().to_string(), accumulation);
        args.extend(common::LORA_FLAGS.map(str::to_owned));
        args.extend(
            [
                "--eval-data",
                &eval.display().to_string(),
                "--eval-steps",
                "3",
            ]
            .map(str::to_owned),
        );
        args
    };
    let one = dir.join("one");
    let output = padfree(&as_str(&args(&one, 2)));
    assert!(output.status.success(), "{}", stderr(&output));
    let two = dir.join("two");
    let output = mpirun(2, &as_str(&args(&two, 1)), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    // The adapters' moments sharded over the ranks.
    let sharded = dir.join("sharded");
    let mut sharded_args = args(&sharded, 1);
    sharded_args.extend(["--zero-stage".to_owned(), "1".to_owned()]);
    let output = mpirun(2, &as_str(&sharded_args), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    // Each layer's adapters exchanged under the recomputed backward pass
    // (recomputation adds a few sums in another order: within 1e-6 too).
    let overlapped = dir.join("overlapped");
    let mut overlapped_args = args(&overlapped, 1);
    overlapped_args.extend(["--gradient-checkpointing", "--ddp-overlap"].map(str::to_owned));
    let output = mpirun(2, &as_str(&overlapped_args), &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let eval_losses = |dir: &Path| -> Vec<f64> {
        trainer_state(dir)["log_history"]
            .as_array()
            .expect("history")
            .iter()
            .filter_map(|r| r["eval_loss"].as_f64())
            .collect()
    };
    assert_eq!(eval_losses(&one).len(), 2, "evaluated at steps 3 and 6");
    for run in [&two, &sharded, &overlapped] {
        for (what, ours, theirs) in [
            ("step", step_losses(run), step_losses(&one)),
            ("eval", eval_losses(run), eval_losses(&one)),
        ] {
            assert_eq!(
                ours.len(),
                theirs.len(),
                "{what} losses of {}",
                run.display()
            );
            for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "{}: {what} loss {}: {a} vs {b}",
                    run.display(),
                    step + 1
                );
            }
        }
    }
    let adapters = |dir: &Path| tensors_of(&dir.join("adapter_model.safetensors"));
    let (ours, theirs) = (adapters(&two), adapters(&one));
    assert_eq!(ours.len(), theirs.len());
    for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
        let relative = relative_l2(a, b);
        assert!(relative <= 2e-6, "{name}: relative error {relative}");
    }
}

/// A cold start on 2 ranks: each streams half of the records into a share
/// (through a helper, or itself with malloc untuned) and rank 0 joins the
/// halves (said by rank 0); the next start reads the entry back; all train
/// as the run without a cache does. A bad record in the second half is
/// both ranks' error, and leaves no entry or share.
#[test]
fn ranks_share_the_tokenization_of_a_cold_start() {
    let guard = scratch("mpi-data-cache");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let cache = dir.join("cache").display().to_string();
    let launch = |name: &str, data: &str, extra: &[&str], env: &[(&str, &str)]| {
        let out = dir.join(name).display().to_string();
        let mut args = run_args(&config, data, &out, 1);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        mpirun(2, &as_str(&args), env)
    };
    let run = |name: &str, extra: &[&str], env: &[(&str, &str)]| {
        let output = launch(name, &data, extra, env);
        assert!(output.status.success(), "{}", stderr(&output));
        (
            String::from_utf8_lossy(&output.stdout).into_owned(),
            step_losses(&dir.join(name)),
        )
    };
    let (cold, cold_losses) = run("cold", &["--data-cache-dir", &cache], &[]);
    assert!(cold.contains("by 2 ranks"), "{cold}");
    let (warm, warm_losses) = run("warm", &["--data-cache-dir", &cache], &[]);
    assert!(warm.contains(": reused "), "{warm}");
    let untuned = dir.join("cache-untuned").display().to_string();
    let (by_ranks, by_ranks_losses) = run(
        "untuned",
        &["--data-cache-dir", &untuned],
        &[("PADFREE_MALLOC", "system")],
    );
    assert!(by_ranks.contains("by 2 ranks"), "{by_ranks}");
    let (_, uncached) = run("uncached", &["--no-data-cache"], &[]);
    assert_eq!(cold_losses, uncached);
    assert_eq!(warm_losses, uncached);
    assert_eq!(by_ranks_losses, uncached);
    let entries = std::fs::read_dir(dir.join("cache")).expect("cache").count();
    assert_eq!(entries, 1, "the entry alone, no shares left");
    let mut lines: Vec<String> = std::fs::read_to_string(&data)
        .expect("data")
        .lines()
        .map(str::to_owned)
        .collect();
    lines[30] = "{\"question\": 3, \"answer\": \"4\"}".into();
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, lines.join("\n")).expect("write");
    let bad_cache = dir.join("cache-bad").display().to_string();
    let output = launch(
        "bad",
        &bad.display().to_string(),
        &["--data-cache-dir", &bad_cache],
        &[],
    );
    assert!(!output.status.success());
    let err = stderr(&output);
    assert_eq!(err.matches("line 31").count(), 2, "both ranks: {err}");
    let left = std::fs::read_dir(dir.join("cache-bad")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "no entry, no share");
}
