//! Where a model runs: `--device cpu|vulkan|wgpu|metal|dx12|cuda`, opened
//! once per process and named by what actually came up.
//!
//! A device that cannot be opened (no driver, no adapter, a runtime not
//! built in) is refused by name with a HINT; nothing is replaced silently.
//! wgpu's own habit of falling back to OpenGL (Mesa's llvmpipe) when no
//! Vulkan driver loads is refused too: padfree pins the graphics API of every
//! GPU choice except `wgpu`, and refuses OpenGL under `wgpu`.

use std::fmt;
use std::str::FromStr;

use crate::precision::HalfFloat;
use crate::tensor::Device;

/// A device as the command line names it: `cpu`, or a GPU runtime with an
/// optional adapter index (`vulkan:1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// burn's Flex backend with padfree's fused host kernels (the default).
    #[default]
    Cpu,
    /// A GPU through one of burn's runtimes.
    Gpu {
        /// Which runtime and graphics API.
        api: GpuApi,
        /// The adapter's index among the adapters of that API; `None` takes
        /// the one wgpu ranks first (a discrete GPU before an integrated one
        /// before a software one).
        index: Option<usize>,
    },
}

/// The GPU runtimes `--device` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuApi {
    /// wgpu on Vulkan (WGSL shaders): NVIDIA, AMD, Intel on Linux and
    /// Windows; Mesa's lavapipe in CI.
    Vulkan,
    /// wgpu on whichever API the machine offers first (Vulkan, Metal, DX12);
    /// OpenGL is refused.
    Wgpu,
    /// wgpu on Metal (Apple).
    Metal,
    /// wgpu on DirectX 12 (Windows).
    Dx12,
    /// burn's CUDA runtime, NVRTC-compiled kernels (feature `cuda`;
    /// `docs/gpu.md`).
    Cuda,
}

impl GpuApi {
    /// The name `--device` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vulkan => "vulkan",
            Self::Wgpu => "wgpu",
            Self::Metal => "metal",
            Self::Dx12 => "dx12",
            Self::Cuda => "cuda",
        }
    }
}

impl DeviceChoice {
    /// True for a GPU.
    pub fn is_gpu(self) -> bool {
        matches!(self, Self::Gpu { .. })
    }

    /// The same runtime at `index`, unless an index was given: how data-
    /// parallel ranks each take their own adapter.
    pub fn with_default_index(self, index: usize) -> Self {
        match self {
            Self::Gpu { api, index: None } => Self::Gpu {
                api,
                index: Some(index),
            },
            other => other,
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Gpu { api, index: None } => write!(f, "{}", api.name()),
            Self::Gpu {
                api,
                index: Some(i),
            } => write!(f, "{}:{i}", api.name()),
        }
    }
}

/// `--device` values padfree knows, for error messages.
pub const DEVICE_NAMES: &str =
    "cpu, vulkan, wgpu, metal, dx12, cuda (GPU names take an adapter index: vulkan:1)";

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, index) = match s.split_once(':') {
            Some((name, index)) => {
                let index = index.parse::<usize>().map_err(|_| {
                    format!("`{s}`: the adapter index after `:` must be a number (vulkan:0)")
                })?;
                (name, Some(index))
            }
            None => (s, None),
        };
        let api = match name.to_ascii_lowercase().as_str() {
            "cpu" if index.is_none() => return Ok(Self::Cpu),
            "cpu" => return Err(format!("`{s}`: the CPU takes no index")),
            "vulkan" => GpuApi::Vulkan,
            "wgpu" | "gpu" => GpuApi::Wgpu,
            "metal" => GpuApi::Metal,
            "dx12" => GpuApi::Dx12,
            "cuda" => GpuApi::Cuda,
            _ => {
                return Err(format!(
                    "unknown device `{s}`; padfree knows {DEVICE_NAMES}"
                ));
            }
        };
        Ok(Self::Gpu { api, index })
    }
}

/// A device that came up, and what it is.
#[derive(Debug, Clone)]
pub struct OpenedDevice {
    /// What was asked for.
    pub choice: DeviceChoice,
    /// The device, without autodiff.
    pub device: Device,
    /// The adapter's name, API, driver and type, as the runtime reports them
    /// (`cpu (Flex, N threads)` for the CPU).
    pub description: String,
}

/// Why a device could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError {
    /// What was asked for.
    pub choice: String,
    /// What went wrong.
    pub message: String,
    /// What to do.
    pub hint: String,
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device `{}`: {}\nHINT: {}",
            self.choice, self.message, self.hint
        )
    }
}

impl std::error::Error for DeviceError {}

/// Opens `choice` (once per process: a second call returns the same device).
pub fn open_device(choice: DeviceChoice) -> Result<OpenedDevice, DeviceError> {
    match choice {
        DeviceChoice::Cpu => Ok(OpenedDevice {
            choice,
            device: Device::flex(),
            description: format!("cpu (burn Flex, {} threads)", rayon::current_num_threads()),
        }),
        DeviceChoice::Gpu {
            api: GpuApi::Cuda,
            index,
        } => cuda::open(choice, index),
        DeviceChoice::Gpu { api, index } => gpu::open(choice, api, index),
    }
}

/// Bytes of device memory burn's CubeCL runtime holds on `device` (its
/// pools' reservations from the driver, every stream), or `None` on the
/// CPU and in a build without GPU runtimes. The pools keep what they
/// reserved, so read after a step this is the step's high-water mark to
/// the pools' page size.
pub fn device_memory_reserved(device: &Device) -> Option<u64> {
    if crate::kernels::on_cpu(device) {
        return None;
    }
    reserved_on_gpu(device)
}

/// `f` of a one-element tensor of `device`'s CubeCL runtime (any tensor
/// reaches the runtime's client), or `None` off that backend.
#[cfg(feature = "cube")]
fn on_gpu_client<T>(
    device: &Device,
    f: impl FnOnce(&burn_cubecl::tensor::CubeTensor) -> T,
) -> Option<T> {
    let probe = crate::tensor::float_tensor(vec![0.0], [1], &device.clone().inner());
    let tensor = probe
        .try_into_primitive::<burn_cubecl::CubeBackend>()
        .ok()?;
    Some(f(&tensor))
}

#[cfg(feature = "cube")]
fn reserved_on_gpu(device: &Device) -> Option<u64> {
    on_gpu_client(device, |tensor| {
        let report = tensor.client.memory_report(cubecl::MemoryScope::Device);
        report.usage().bytes_reserved
    })
}

#[cfg(not(feature = "cube"))]
fn reserved_on_gpu(_: &Device) -> Option<u64> {
    None
}

/// The 16-bit float `--bf16` multiplies in on `device`: bf16 where its
/// runtime has it (CUDA), else f16 where it has that (WGSL with
/// `shader-f16`); `None` on the CPU, on a GPU with neither, and in a build
/// without GPU runtimes.
pub fn half_float(device: &Device) -> Option<HalfFloat> {
    if crate::kernels::on_cpu(device) {
        return None;
    }
    half_on_gpu(device)
}

#[cfg(feature = "cube")]
fn half_on_gpu(device: &Device) -> Option<HalfFloat> {
    use cubecl::ir::{ElemType, FloatKind};
    on_gpu_client(device, |tensor| {
        let properties = tensor.client.properties();
        [
            (FloatKind::BF16, HalfFloat::Bf16),
            (FloatKind::F16, HalfFloat::F16),
        ]
        .into_iter()
        .find(|(kind, _)| properties.supports_type(ElemType::Float(*kind)))
        .map(|(_, half)| half)
    })
    .flatten()
}

#[cfg(not(feature = "cube"))]
fn half_on_gpu(_: &Device) -> Option<HalfFloat> {
    None
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{DeviceChoice, DeviceError, OpenedDevice};

    pub(super) fn open(
        choice: DeviceChoice,
        _index: Option<usize>,
    ) -> Result<OpenedDevice, DeviceError> {
        Err(DeviceError {
            choice: choice.to_string(),
            message: "this padfree was built without burn's CUDA runtime".into(),
            hint: "build with `cargo build --release --features cuda` (offline: docs/gpu.md, \
                   \"The CUDA build\"), or on an NVIDIA GPU use `--device vulkan` (NVIDIA's \
                   Vulkan driver)"
                .into(),
        })
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{DeviceChoice, DeviceError, OpenedDevice};
    use crate::tensor::Device;

    /// Opens CUDA device `index` (0 without one) and runs one small
    /// operation on it: cubecl opens the driver lazily and panics when it
    /// cannot (no `libcuda.so`, no device, no NVRTC), so the first use is
    /// made here, where a panic becomes a refusal that says what is missing.
    pub(super) fn open(
        choice: DeviceChoice,
        index: Option<usize>,
    ) -> Result<OpenedDevice, DeviceError> {
        let index = index.unwrap_or(0);
        let tried = quietly(|| {
            let device = Device::cuda(index);
            let probe = burn::tensor::Tensor::<1>::from_floats([1.0f32, 2.0], &device) * 2.0;
            let values = probe.into_data().try_to_vec::<f32>().unwrap_or_default();
            (device, values)
        });
        match tried {
            Ok((device, values)) if values == [2.0, 4.0] => Ok(OpenedDevice {
                choice,
                device,
                description: format!("CUDA device {index} (burn's CUDA runtime, NVRTC kernels)"),
            }),
            Ok((_, values)) => Err(DeviceError {
                choice: choice.to_string(),
                message: format!("CUDA device {index} computed [1, 2] * 2 as {values:?}"),
                hint: "check the driver with `nvidia-smi`, or use `--device vulkan`".into(),
            }),
            Err(why) => Err(DeviceError {
                choice: choice.to_string(),
                message: format!("CUDA device {index} could not be opened: {why}"),
                hint: "padfree's CUDA build needs NVIDIA's driver (libcuda.so, `nvidia-smi` \
                       lists the devices), NVRTC (libnvrtc.so.12 or later) on the library path \
                       and CUDA's headers under $CUDA_PATH/include (default /usr/local/cuda; \
                       docs/gpu.md); without them use `--device vulkan` or `--device cpu`"
                    .into(),
            }),
        }
    }

    /// `run`, or the first panic message of any thread while it ran (the
    /// runtime opens the driver on a thread of its own, whose panic reaches
    /// `run` only as a closed channel), instead of printing them.
    fn quietly<T>(run: impl FnOnce() -> T) -> Result<T, String> {
        use std::sync::{Arc, Mutex};
        let first: Arc<Mutex<Option<String>>> = Arc::default();
        let hook = std::panic::take_hook();
        let seen = first.clone();
        std::panic::set_hook(Box::new(move |info| {
            let mut seen = seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            seen.get_or_insert_with(|| {
                let payload = info.payload();
                payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "the runtime panicked".to_owned())
            });
        }));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        std::panic::set_hook(hook);
        let first = first
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        match (result, first) {
            (Ok(value), _) => Ok(value),
            (Err(_), Some(message)) => Err(message),
            (Err(_), None) => Err("the runtime panicked".to_owned()),
        }
    }
}

#[cfg(not(feature = "wgpu"))]
mod gpu {
    use super::{DeviceChoice, DeviceError, GpuApi, OpenedDevice};

    pub(super) fn open(
        choice: DeviceChoice,
        _api: GpuApi,
        _index: Option<usize>,
    ) -> Result<OpenedDevice, DeviceError> {
        Err(DeviceError {
            choice: choice.to_string(),
            message: "this padfree was built without GPU support".into(),
            hint: "build with `cargo build --release --features wgpu` (docs/gpu.md), or use \
                   `--device cpu`"
                .into(),
        })
    }
}

#[cfg(feature = "wgpu")]
mod gpu {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use burn::tensor::DeviceKind;
    use burn::tensor::wgpu::{WgpuBackend, wgpu};

    use super::{DeviceChoice, DeviceError, GpuApi, OpenedDevice};
    use crate::tensor::Device;

    /// Devices opened so far: a wgpu adapter can be set up once per process.
    static OPENED: Mutex<Option<HashMap<String, OpenedDevice>>> = Mutex::new(None);

    pub(super) fn open(
        choice: DeviceChoice,
        api: GpuApi,
        index: Option<usize>,
    ) -> Result<OpenedDevice, DeviceError> {
        let key = choice.to_string();
        let mut opened = OPENED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let opened = opened.get_or_insert_with(HashMap::new);
        if let Some(device) = opened.get(&key) {
            return Ok(device.clone());
        }
        let device = open_new(choice, api, index)?;
        opened.insert(key, device.clone());
        Ok(device)
    }

    fn open_new(
        choice: DeviceChoice,
        api: GpuApi,
        index: Option<usize>,
    ) -> Result<OpenedDevice, DeviceError> {
        let refuse = |message: String, hint: &str| DeviceError {
            choice: choice.to_string(),
            message,
            hint: hint.to_owned(),
        };
        let backend = match api {
            GpuApi::Vulkan => WgpuBackend::Vulkan,
            GpuApi::Wgpu => WgpuBackend::Auto,
            GpuApi::Metal => WgpuBackend::Metal,
            GpuApi::Dx12 => WgpuBackend::Dx12,
            GpuApi::Cuda => unreachable!("opened by `cuda::open`"),
        };
        let kind = match index {
            None => DeviceKind::DefaultDevice,
            Some(i) => match adapter_kind(backend, i) {
                Some(kind) => kind,
                None => {
                    return Err(refuse(
                        format!("there is no adapter {i}; {}", adapters_seen(backend)),
                        "pick an index from the list, or leave it out for the first one",
                    ));
                }
            },
        };
        let (device, setup) = Device::wgpu_options()
            .graphics_api(backend)
            .device_kind(kind)
            .init_with_setup()
            .map_err(|err| {
                refuse(
                    format!("{err}; {}", adapters_seen(backend)),
                    match api {
                        GpuApi::Vulkan => {
                            "install the GPU's Vulkan driver (Debian: mesa-vulkan-drivers for \
                             AMD, Intel and the lavapipe software device; NVIDIA's driver ships \
                             its own) and libvulkan1; `vulkaninfo --summary` lists what loads"
                        }
                        GpuApi::Metal => "Metal needs macOS on Apple silicon or a Metal GPU",
                        GpuApi::Dx12 => "DirectX 12 needs Windows 10 or later",
                        _ => "`vulkaninfo --summary` lists the Vulkan devices that load",
                    },
                )
            })?;
        let info = setup.adapter.get_info();
        if info.backend == wgpu::Backend::Gl {
            return Err(refuse(
                format!(
                    "wgpu came up on OpenGL ({}), not on a compute API",
                    info.name
                ),
                "padfree does not train on wgpu's OpenGL fallback; install a Vulkan driver \
                 (`--device vulkan` says why it does not load)",
            ));
        }
        let description = format!(
            "{} ({:?}, {:?}, driver {} {}, WGSL shaders)",
            info.name, info.backend, info.device_type, info.driver, info.driver_info
        );
        Ok(OpenedDevice {
            choice,
            device,
            description,
        })
    }

    fn instance(backend: WgpuBackend) -> (wgpu::Instance, wgpu::Backends) {
        let backends = match backend {
            WgpuBackend::Vulkan => wgpu::Backends::VULKAN,
            WgpuBackend::Metal => wgpu::Backends::METAL,
            WgpuBackend::Dx12 => wgpu::Backends::DX12,
            _ => wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        };
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        (instance, backends)
    }

    fn adapters(backend: WgpuBackend) -> Vec<wgpu::AdapterInfo> {
        let (instance, backends) = instance(backend);
        cubecl::future::block_on(instance.enumerate_adapters(backends))
            .iter()
            .map(wgpu::Adapter::get_info)
            .collect()
    }

    /// The adapters an API offers, for a refusal's message.
    fn adapters_seen(backend: WgpuBackend) -> String {
        let seen = adapters(backend);
        if seen.is_empty() {
            return "no adapter found".to_owned();
        }
        let names: Vec<String> = seen
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i}: {} ({:?}, {:?})", a.name, a.backend, a.device_type))
            .collect();
        format!("adapters found: {}", names.join("; "))
    }

    /// wgpu numbers adapters within their type (the 2nd discrete GPU is
    /// `DiscreteGpu(1)`); padfree numbers them in enumeration order.
    fn adapter_kind(backend: WgpuBackend, index: usize) -> Option<DeviceKind> {
        let seen = adapters(backend);
        let target = seen.get(index)?;
        let within = seen[..index]
            .iter()
            .filter(|a| a.device_type == target.device_type)
            .count();
        Some(match target.device_type {
            wgpu::DeviceType::DiscreteGpu => DeviceKind::DiscreteGpu(within),
            wgpu::DeviceType::IntegratedGpu => DeviceKind::IntegratedGpu(within),
            wgpu::DeviceType::VirtualGpu => DeviceKind::VirtualGpu(within),
            wgpu::DeviceType::Cpu => DeviceKind::Cpu,
            wgpu::DeviceType::Other => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_with_and_without_an_index() {
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!(
            "vulkan:1".parse::<DeviceChoice>(),
            Ok(DeviceChoice::Gpu {
                api: GpuApi::Vulkan,
                index: Some(1)
            })
        );
        assert_eq!(
            "wgpu".parse::<DeviceChoice>().map(|c| c.to_string()),
            Ok("wgpu".to_owned())
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert!("vulkan:x".parse::<DeviceChoice>().is_err());
        assert!("cpu:0".parse::<DeviceChoice>().is_err());
    }

    /// Without the feature, or without a driver (CI builds `cuda` with no
    /// GPU), `--device cuda` is refused by name with what to do.
    #[test]
    fn cuda_is_refused_by_name_with_a_hint_where_it_cannot_run() {
        let opened = open_device(DeviceChoice::Gpu {
            api: GpuApi::Cuda,
            index: None,
        });
        let has_driver = std::path::Path::new("/proc/driver/nvidia/version").exists();
        if cfg!(feature = "cuda") && has_driver {
            opened.expect("a CUDA build with NVIDIA's driver opens the device");
            return;
        }
        let err = opened.expect_err("cannot run here");
        assert!(err.to_string().contains("device `cuda`"), "{err}");
        assert!(err.to_string().contains("--device vulkan"), "{err}");
        if cfg!(not(feature = "cuda")) {
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
    }

    #[cfg(not(feature = "wgpu"))]
    #[test]
    fn a_gpu_without_the_feature_is_refused_before_any_work() {
        let err = open_device("vulkan".parse().expect("parses")).expect_err("not built");
        assert!(err.to_string().contains("--features wgpu"), "{err}");
    }
}
