//! Where a step's and an evaluation's passes run: on a thread of rayon's
//! pool on the CPU, on the calling thread on a GPU.

/// Runs `f` on a thread of rayon's pool, where the kernels' parallel loops
/// and gemm's threads then start without a hand-over: called from outside
/// the pool, every one of the hundreds of parallel calls of a step queues
/// its work, wakes a worker through the kernel (a futex) and sleeps until
/// it is done. That hand-over was 11% of a short-example step on `medium`
/// (2 threads, a virtual machine); inside the pool it happens once. MPI
/// calls stay on the calling thread (funneled threading).
///
/// Not on a GPU (`on_device`), where `f` runs on the calling thread:
/// cubecl gives each OS thread a stream of its own, and whichever worker
/// took a micro-batch put its launches on that worker's stream, while the
/// weights, the update and the next micro-batch were on others; a buffer
/// crossing streams then has them synchronised, and each stream's
/// buffers came from pools of their own (cubecl 0.11's wgpu and CUDA
/// streams each own a `MemoryManagement`: their `compute/stream.rs`).
/// On one thread the whole step is
/// one stream, in program order: a SmolLM2-135M run on lavapipe (two
/// micro-batches a step) held 3,061 MiB of pools in every run, where on
/// the workers it held 3,832 or 4,386 from run to run, the same values.
pub(crate) fn on_workers<R: Send>(on_device: bool, f: impl FnOnce() -> R + Send) -> R {
    if on_device {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

#[cfg(test)]
mod tests {
    use super::on_workers;

    /// A GPU's step stays on the calling thread (one cubecl stream); a
    /// CPU's runs on rayon's pool.
    #[test]
    fn device_steps_stay_on_the_calling_thread() {
        let caller = std::thread::current().id();
        assert_eq!(on_workers(true, || std::thread::current().id()), caller);
        assert_eq!(on_workers(true, rayon::current_thread_index), None);
        assert!(on_workers(false, rayon::current_thread_index).is_some());
    }
}
