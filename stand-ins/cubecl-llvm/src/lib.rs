//! padfree's stand-in for `cubecl-llvm` 0.11.3 (see `Cargo.toml`).
//!
//! `cubecl-cuda` names these items whichever of its two compilers runs:
//! the target and options it builds an LLVM compiler from, the artifact it
//! unwraps, the PTX version it records per driver, and the feature
//! narrowing it applies when LLVM is the compiler. With cubecl-cuda's `cpp`
//! feature (padfree's `cuda` build always sets it) the CUDA C++ compiler
//! and NVRTC run, and none of this is called but the PTX version, which
//! only names the LLVM compiler's cache. Anything that does ask this
//! crate to compile gets [`CompilationError::Generic`] saying why.

use cubecl_core::Compiler;
use cubecl_core::prelude::KernelDefinition;
use cubecl_runtime::compiler::CompilationError;
use cubecl_runtime::kernel::BufferIOAttr;

/// Where cubecl's LLVM compiler would emit code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// Host code (cubecl's CPU runtime).
    #[default]
    Cpu,
    /// NVIDIA PTX.
    #[cfg(feature = "nvptx")]
    Nvptx,
}

/// cubecl's LLVM compiler, as cubecl-cuda builds it; here it refuses.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The code it would emit.
    pub target: LlvmTarget,
}

/// The options cubecl-cuda hands the LLVM compiler.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// An AMD architecture (unused by CUDA, always `None` there).
    pub arch: Option<()>,
    /// The NVIDIA architecture compiled for.
    #[cfg(feature = "nvptx")]
    pub sm_arch: Option<cubecl_core::ir::nvidia::SmArch>,
    /// The PTX version to emit.
    #[cfg(feature = "nvptx")]
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Whether scalars travel in the kernel's parameter block.
    pub grid_constants: bool,
}

/// A PTX module as the LLVM compiler would give it.
#[cfg(feature = "nvptx")]
#[derive(Clone, Debug, Default)]
pub struct NvptxModule {
    /// NUL-terminated PTX.
    pub ptx: Vec<std::ffi::c_char>,
    /// The kernel's entry point.
    pub entrypoint: String,
    /// The IR, for logs and cache keys.
    pub ir: String,
    /// Shared memory a launch reserves, in bytes.
    pub shared_memory_size: usize,
    /// What the kernel does with each buffer, in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What the LLVM compiler would give.
#[derive(Debug)]
pub enum PlironArtifact {
    /// A PTX module.
    #[cfg(feature = "nvptx")]
    NvptxCode(NvptxModule),
    /// Nothing: no variant is ever made (the compiler refuses), but a
    /// build without `nvptx` still needs an enum with a variant.
    Never(std::convert::Infallible),
}

impl std::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(feature = "nvptx")]
            Self::NvptxCode(module) => f.write_str(&module.ir),
            Self::Never(never) => match *never {},
        }
    }
}

/// The refusal every compile gets.
pub const REFUSAL: &str = "cubecl's LLVM compiler is not in this build: padfree builds burn's \
    CUDA runtime offline with a stand-in for cubecl-llvm (whose build downloads LLVM) and \
    compiles CUDA kernels through NVRTC only (cubecl-cuda's `cpp` feature). Build with \
    padfree's `cuda` feature, which turns it on.";

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: REFUSAL.to_owned(),
            backtrace: Default::default(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}

/// NVIDIA specifics.
#[cfg(feature = "nvptx")]
pub mod nvptx {
    /// The PTX ISA version for a driver.
    pub mod ptx_version {
        use std::fmt;

        /// A PTX ISA version, major and minor packed as the target feature
        /// spells them (`ptx87` for 8.7).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The PTX version the LLVM compiler would emit for a CUDA
            /// driver `driver` (`cuDriverGetVersion`: 12.8 is `12080`):
            /// `None`, since no PTX is emitted here. cubecl-cuda keeps the
            /// value only to name the LLVM compiler's cache, which never
            /// fills in this build.
            pub fn for_driver(_driver: i32) -> Option<Self> {
                None
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

/// What the compilers share.
pub mod shared {
    /// Device features narrowed to what the LLVM compiler lowers.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// The GPU a device's features would be narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA PTX.
            #[cfg(feature = "nvptx")]
            Nvptx,
        }

        /// Narrows `props` for the LLVM compiler. cubecl-cuda calls it only
        /// when LLVM is its compiler, which a build with this stand-in
        /// refuses to be (`cpp`): the properties stay the CUDA C++
        /// compiler's, untouched.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}
