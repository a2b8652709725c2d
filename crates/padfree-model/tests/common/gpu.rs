//! What the GPU tests (`gpu.rs`, `gpu_half.rs`) share: the device under
//! test, random values, and the ops' outputs with their input gradients.

use padfree_model::LlamaModel;
use padfree_model::device::{DeviceChoice, open_device};
use padfree_model::tensor::{Device, IntoHostVec, Tensor, backward, float_tensor, grad, trainable};
use padfree_pack::SplitMix64;

/// The GPU under test (`PADFREE_TEST_DEVICE`, default `vulkan`), without
/// autodiff; a device that does not open fails with its HINT.
pub fn gpu() -> Device {
    let name = std::env::var("PADFREE_TEST_DEVICE").unwrap_or_else(|_| "vulkan".into());
    let choice: DeviceChoice = name.parse().expect("PADFREE_TEST_DEVICE names a device");
    let opened = open_device(choice).unwrap_or_else(|err| panic!("{err}"));
    eprintln!("GPU under test: {}", opened.description);
    // CI's lavapipe is a Vulkan device; OpenGL is refused when it opens.
    if name == "vulkan" {
        assert!(
            opened.description.contains("(Vulkan,"),
            "not a Vulkan device: {}",
            opened.description
        );
    }
    opened.device
}

/// `n` normal values of standard deviation `scale` from `seed`.
pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| scale * rng.standard_normal() as f32)
        .collect()
}

/// Output and `[dq, dk, dv]` of `sum(out * weights)` through `attention`.
pub fn attention_and_grads(
    device: &Device,
    values: &[Vec<f32>; 4],
    shapes: [[usize; 3]; 2],
    attention: impl Fn(Tensor<3>, Tensor<3>, Tensor<3>) -> Tensor<3>,
) -> (Vec<f32>, [Vec<f32>; 3]) {
    let [q_shape, kv_shape] = shapes;
    let leaf = |v: &Vec<f32>, shape| trainable(float_tensor(v.clone(), shape, device));
    let q = leaf(&values[0], q_shape);
    let k = leaf(&values[1], kv_shape);
    let v = leaf(&values[2], kv_shape);
    let weights = float_tensor(values[3].clone(), q_shape, device);
    let out = attention(q.clone(), k.clone(), v.clone());
    let grads = backward(&(out.clone() * weights).sum());
    let g = |t: &Tensor<3>| grad(t, &grads).expect("a gradient").into_vec();
    (out.into_vec(), [g(&q), g(&k), g(&v)])
}

/// Loss, `dx` and `dhead` of `0.7 * loss_of(x, head)` for random `x`
/// `[K, C]` and `head` `[V, C]` on `device`.
pub fn head_loss_and_grads(
    device: &Device,
    [rows, channels, vocab]: [usize; 3],
    loss_of: impl Fn(Tensor<2>, Tensor<2>) -> Tensor<1>,
) -> (Vec<f32>, [Vec<f32>; 2]) {
    let leaf = |shape: [usize; 2], seed| {
        trainable(float_tensor(
            random(shape[0] * shape[1], seed, 1.0),
            shape,
            device,
        ))
    };
    let (x, head) = (leaf([rows, channels], 31), leaf([vocab, channels], 32));
    let loss = loss_of(x.clone(), head.clone());
    let grads = backward(&(loss.clone() * 0.7));
    let g = |t: &Tensor<2>| grad(t, &grads).expect("a gradient").into_vec();
    (loss.into_vec(), [g(&x), g(&head)])
}

/// `model`'s weights on the GPU under test (with autodiff), through its
/// HF files: the same values on both devices.
pub fn on_gpu(model: &LlamaModel) -> LlamaModel {
    let dir = tempfile::tempdir().expect("scratch dir");
    model.save_hf_dir(dir.path()).expect("saves");
    LlamaModel::from_hf_dir(dir.path(), &gpu().autodiff()).expect("loads")
}
