//! `padfree` on a GPU through the binary (feature `wgpu`; CI runs it on
//! Mesa's lavapipe): 5 training steps on the device against the same steps
//! on the CPU, a GPU checkpoint resumed on the CPU, LoRA steps against the
//! CPU's, gradient accumulation against the CPU and itself, `padfree check` on the device, `padfree bench --attention-alone`'s
//! kernel rows, and a device that does not exist refused before any work.
//!
//! The device is `PADFREE_TEST_DEVICE` (default `vulkan`); never skipped.
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;

use common::{padfree_in_repo, scratch, stderr};

fn device() -> String {
    std::env::var("PADFREE_TEST_DEVICE").unwrap_or_else(|_| "vulkan".into())
}

/// `(step, loss)` of every logged step.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    logged(out, "loss")
}

/// `(step, value of field)` of every logged step that has it.
fn logged(out: &Path, field: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).expect("json line");
            Some((record["step"].as_u64()?, record.get(field)?.as_f64()?))
        })
        .collect()
}

/// The tiny preset on the shipped data, every step logged and saved.
fn train(out: &Path, device: &str, steps: &str, extra: &[&str]) -> String {
    let out_arg = out.display().to_string();
    let mut args = vec![
        "train",
        "--config",
        "tiny",
        "--device",
        device,
        "--max-steps",
        steps,
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-3",
        "--logging-steps",
        "1",
        "--save-steps",
        "1",
        "--eval-strategy",
        "no",
        "--output-dir",
        &out_arg,
    ];
    args.extend(extra);
    let output = padfree_in_repo(&args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    stdout
}

fn assert_losses_close(gpu: &[(u64, f64)], cpu: &[(u64, f64)]) {
    assert_eq!(gpu.len(), cpu.len(), "{gpu:?} vs {cpu:?}");
    for ((gs, g), (cs, c)) in gpu.iter().zip(cpu) {
        assert_eq!(gs, cs);
        assert!(
            (g - c).abs() <= 1e-4 * c.abs(),
            "step {gs}: loss {g} on the GPU, {c} on the CPU"
        );
    }
}

#[test]
fn five_steps_on_the_gpu_match_the_cpu_and_its_checkpoint_resumes_on_the_cpu() {
    let dir = scratch("gpu-train");
    let (gpu_out, cpu_out, resumed_out) = (
        dir.path().join("gpu"),
        dir.path().join("cpu"),
        dir.path().join("resumed"),
    );
    let stdout = train(&gpu_out, &device(), "5", &[]);
    // Which backend ran: the adapter and its API, as the runtime names them.
    assert!(stdout.contains("device: "), "{stdout}");
    if device() == "vulkan" {
        assert!(stdout.contains("(Vulkan,"), "{stdout}");
    }
    assert!(
        stdout.contains("varlen attention: tiled CubeCL kernel"),
        "{stdout}"
    );
    // The device memory the runtime held, beside the host's VmHWM: more
    // than the model's weights (tiny preset: well over 1 MiB of f32 weights,
    // moments and activations) and reported on the GPU only.
    let held = stdout
        .lines()
        .find_map(|line| line.trim().strip_prefix("device memory held       = "))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|mib| mib.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no device memory line: {stdout}"));
    assert!(held >= 1.0, "{held} MiB: {stdout}");
    let cpu_stdout = train(&cpu_out, "cpu", "5", &[]);
    assert!(!cpu_stdout.contains("device memory held"), "{cpu_stdout}");
    let (gpu, cpu) = (losses(&gpu_out), losses(&cpu_out));
    assert_eq!(gpu.len(), 5, "{gpu:?}");
    assert_losses_close(&gpu, &cpu);

    // The GPU's checkpoint after step 3 (HF-named f32 files, moments
    // included) resumed on the CPU continues as the CPU run did.
    let checkpoint = gpu_out.join("checkpoint-3").display().to_string();
    train(
        &resumed_out,
        "cpu",
        "5",
        &["--resume-from-checkpoint", &checkpoint],
    );
    let resumed = losses(&resumed_out);
    let tail: Vec<_> = cpu.iter().filter(|(step, _)| *step > 3).copied().collect();
    let resumed_tail: Vec<_> = resumed
        .iter()
        .filter(|(step, _)| *step > 3)
        .copied()
        .collect();
    assert_losses_close(&resumed_tail, &tail);
}

/// Gradient accumulation on the GPU: four micro-batches a step, the
/// gradients summed on the device eight tensors a launch
/// (`kernels::add_pairs`). Its losses and gradient norms match the CPU's,
/// and a second run repeats the first to the bit (summed with burn's
/// `add` a tensor at a time, the same run on lavapipe gave different
/// gradient norms from run to run).
#[test]
fn gradient_accumulation_on_the_gpu_matches_the_cpu_and_repeats_to_the_bit() {
    accumulation_matches_the_cpu_and_repeats("gpu-accumulation", &[]);
}

/// The same with per-layer recomputation, whose gradients arrive a
/// segment at a time, each taken out of the segment's container and added
/// in place.
#[test]
fn checkpointed_gradient_accumulation_on_the_gpu_matches_the_cpu_and_repeats_to_the_bit() {
    accumulation_matches_the_cpu_and_repeats(
        "gpu-checkpointed-accumulation",
        &["--gradient-checkpointing"],
    );
}

/// Three steps of four micro-batches on the device twice and on the CPU
/// once, with `extra` flags: the device's losses and gradient norms repeat
/// to the bit, and are the CPU's within 1e-4.
fn accumulation_matches_the_cpu_and_repeats(name: &str, extra: &[&str]) {
    let dir = scratch(name);
    let runs = ["gpu", "again", "cpu"].map(|name| dir.path().join(name));
    let mut flags = vec!["--gradient-accumulation-steps", "4"];
    flags.extend_from_slice(extra);
    train(&runs[0], &device(), "3", &flags);
    train(&runs[1], &device(), "3", &flags);
    train(&runs[2], "cpu", "3", &flags);
    let [gpu, again, cpu] = runs.each_ref().map(|out| losses(out));
    let [gpu_norms, again_norms, cpu_norms] = runs.each_ref().map(|out| logged(out, "grad_norm"));
    assert_eq!(gpu.len(), 3, "{gpu:?}");
    assert_eq!(gpu_norms.len(), 3, "{gpu_norms:?}");
    let bits = |rows: &[(u64, f64)]| {
        rows.iter()
            .map(|(s, v)| (*s, v.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&gpu), bits(&again), "losses: {gpu:?} then {again:?}");
    assert_eq!(
        bits(&gpu_norms),
        bits(&again_norms),
        "gradient norms: {gpu_norms:?} then {again_norms:?}"
    );
    assert_losses_close(&gpu, &cpu);
    for ((step, g), (_, c)) in gpu_norms.iter().zip(&cpu_norms) {
        assert!(
            (g - c).abs() <= 1e-4 * c.abs(),
            "step {step}: gradient norm {g} on the GPU, {c} on the CPU"
        );
    }
}

/// LoRA adapters (every linear layer, dropout on: its masks are drawn on
/// the host, the same on both devices) train on the GPU as on the CPU.
#[test]
fn lora_steps_on_the_gpu_match_the_cpu() {
    let dir = scratch("gpu-lora");
    let (gpu_out, cpu_out) = (dir.path().join("gpu"), dir.path().join("cpu"));
    train(&gpu_out, &device(), "4", &common::LORA_FLAGS);
    train(&cpu_out, "cpu", "4", &common::LORA_FLAGS);
    assert!(gpu_out.join("adapter_model.safetensors").is_file());
    let (gpu, cpu) = (losses(&gpu_out), losses(&cpu_out));
    assert_eq!(gpu.len(), 4, "{gpu:?}");
    assert_losses_close(&gpu, &cpu);
}

#[test]
fn the_packing_check_passes_on_the_gpu() {
    let output = padfree_in_repo(&[
        "check",
        "--config",
        "tiny",
        "--device",
        &device(),
        "--per-device-train-batch-size",
        "3",
        "--batches",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    assert!(stdout.contains("device: "), "{stdout}");
}

#[test]
fn an_adapter_that_does_not_exist_is_refused_before_any_work() {
    let dir = scratch("gpu-refused");
    let out = dir.path().join("out");
    let name = format!("{}:99", device());
    let output = one_tiny_step(&name, &out);
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(err.contains(&format!("device `{name}`")), "{err}");
    assert!(err.contains("HINT"), "{err}");
    assert!(!out.exists(), "nothing written for a refused device");
}

/// The CUDA build (feature `cuda`, built offline): where NVIDIA's driver
/// is, one step trains on `--device cuda`; elsewhere (CI) the device is
/// refused before any work with what is missing (the runtime's own panic,
/// caught, and a HINT), nothing written.
#[cfg(feature = "cuda")]
#[test]
fn cuda_trains_where_the_driver_is_and_is_refused_with_what_is_missing_elsewhere() {
    let dir = scratch("gpu-cuda");
    let out = dir.path().join("out");
    let output = one_tiny_step("cuda", &out);
    let err = stderr(&output);
    if Path::new("/proc/driver/nvidia/version").exists() {
        assert!(output.status.success(), "{err}");
        return;
    }
    assert!(!output.status.success());
    assert!(
        err.contains("device `cuda`: CUDA device 0 could not be opened"),
        "{err}"
    );
    assert!(err.contains("HINT: padfree's CUDA build needs"), "{err}");
    assert!(!err.contains("panicked at"), "the panic is caught: {err}");
    assert!(!out.exists(), "nothing written for a refused device");
}

/// `padfree train` of one step of the `tiny` preset on `device` into `out`.
fn one_tiny_step(device: &str, out: &Path) -> std::process::Output {
    let out = out.display().to_string();
    padfree_in_repo(&[
        "train",
        "--config",
        "tiny",
        "--device",
        device,
        "--max-steps",
        "1",
        "--output-dir",
        &out,
    ])
}

/// `--bf16` on the GPU: the log names the 16-bit float the products take
/// (f16 on lavapipe, whose WGSL has no bf16; bf16 on CUDA), 4 steps whose
/// losses track the same run in f32 on the device within 1% (f16 rounds
/// every product's operands to 11 bits); the same for LoRA adapters.
#[test]
fn bf16_on_the_gpu_multiplies_in_its_16_bit_float_and_tracks_f32() {
    let dir = scratch("gpu-bf16");
    let (half_out, f32_out) = (dir.path().join("half"), dir.path().join("f32"));
    let stdout = train(&half_out, &device(), "4", &["--bf16"]);
    let expected = if device().starts_with("cuda") {
        "bf16 operands on the GPU's CubeCL matmul"
    } else {
        "f16 operands on the GPU's CubeCL matmul"
    };
    assert!(stdout.contains(expected), "{stdout}");
    train(&f32_out, &device(), "4", &[]);
    tracks_within_1_percent("full fine-tuning", &half_out, &f32_out);

    // LoRA: the frozen base's products in 16 bits from its device copy,
    // the adapters' low-rank products from rounded operands; the adapters
    // train (their steps' losses move as f32's do) and are saved.
    let (lora_half, lora_f32) = (dir.path().join("lora-half"), dir.path().join("lora-f32"));
    let mut flags = vec!["--bf16"];
    flags.extend(common::LORA_FLAGS);
    let stdout = train(&lora_half, &device(), "4", &flags);
    assert!(stdout.contains(expected), "{stdout}");
    train(&lora_f32, &device(), "4", &common::LORA_FLAGS);
    assert!(lora_half.join("adapter_model.safetensors").is_file());
    let half = tracks_within_1_percent("LoRA", &lora_half, &lora_f32);
    assert_ne!(half[0].1, half[3].1, "the adapters train");
}

/// The 4 step losses of the 16-bit run in `half` within 1% of the f32
/// run's in `full`, and not equal to them; the 16-bit losses.
fn tracks_within_1_percent(what: &str, half: &Path, full: &Path) -> Vec<(u64, f64)> {
    let (half, full) = (losses(half), losses(full));
    assert_eq!(half.len(), 4, "{what}: {half:?}");
    for ((step, h), (_, f)) in half.iter().zip(&full) {
        assert!(
            (h - f).abs() <= 1e-2 * f.abs(),
            "{what} step {step}: {h} in 16-bit, {f} in f32"
        );
    }
    assert_ne!(
        half, full,
        "{what}: 16-bit products must show in the losses"
    );
    half
}

/// `padfree bench --attention-alone --bf16` on the GPU: every kernel row,
/// the tiled kernels with a group's query heads in one workgroup, the
/// per-row ones, the tiled ones with one head a workgroup (the tiny preset
/// has 4 query heads over 2 key/value heads) and the 16-bit tiled ones,
/// each timed over the same micro-batches; nothing trained.
#[test]
fn the_attention_alone_on_the_gpu_times_every_kernel() {
    let dir = scratch("gpu-attention-alone");
    let out = dir.path().join("out");
    let (out_arg, device) = (out.display().to_string(), device());
    let output = padfree_in_repo(
        &[
            "bench",
            "--config",
            "tiny",
            "--device",
            &device,
            "--attention-alone",
            "--bf16",
            "--output-dir",
            &out_arg,
        ]
        .into_iter()
        .chain(common::QUICK_BENCH)
        .collect::<Vec<_>>(),
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!out.join("bench.json").exists(), "nothing trained");
    let (kernels, timings) = common::attention_rows(&out);
    let half = if device.starts_with("cuda") {
        "tiled bf16"
    } else {
        "tiled f16"
    };
    assert_eq!(
        kernels,
        [
            "tiled f32",
            "per-row f32",
            "tiled f32, a head a workgroup",
            half
        ]
    );
    for t in &timings {
        assert_eq!(t["calls"], 2, "{t}");
        assert!(t["ms_per_call"].as_f64().expect("ms") > 0.0, "{t}");
    }
}
