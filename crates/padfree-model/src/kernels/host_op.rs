//! padfree's fused kernels as burn operations: a kernel written for host
//! slices (forward and backward) becomes a differentiable tensor op through
//! burn's backend-extension API (`Backward` on the autodiff-decorated Flex
//! backend), for plain autodiff and for gradient checkpointing alike.
//!
//! This file touches burn's extension crates (`burn-autodiff`,
//! `burn-flex`), which break more often than the tensor API; the kernels
//! themselves know nothing of burn.

use std::sync::Arc;

use burn::tensor::{GradientCheckpointingStrategy, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::retro_forward::RetroForward;
use burn_autodiff::checkpoint::state::BackwardStates;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn_backend::tensor::FloatTensor;
use burn_flex::{Flex, FlexTensor};

/// Why a tensor could not go through a fused kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsupportedTensor(pub String);

/// Row-major f32 values and their shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostTensor<'a> {
    pub values: &'a [f32],
    pub shape: &'a [usize],
}

/// What a forward pass produces.
#[derive(Debug, Clone)]
pub(crate) struct HostOutput {
    /// The output, row-major.
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
    /// Anything else the backward pass needs (e.g. row statistics).
    pub saved: Vec<f32>,
}

/// A fused kernel with `N` float inputs and one output.
pub(crate) trait HostOp<const N: usize>:
    Clone + Send + Sync + std::fmt::Debug + 'static
{
    /// Cheap, memory-bound ops (norms, gates) keep only their inputs and run
    /// the forward pass again in the backward one; under gradient
    /// checkpointing their inputs may be recomputed too. Expensive ones
    /// (attention) keep their output and saved values.
    const RECOMPUTE: bool = false;

    /// Whether the backward pass reads the forward output (kept ops only):
    /// a linear layer's input gradient does not, and keeping it would hold
    /// the whole output until the backward pass.
    const KEEPS_OUTPUT: bool = true;

    /// Whether the backward pass reads the inputs (kept ops only): a
    /// linear map with constant coefficients (RoPE) needs only `d_out`,
    /// and gets empty input values with the inputs' shapes.
    const KEEPS_INPUTS: bool = true;

    /// With [`Self::KEEPS_INPUTS`], whether input `index` is kept, decided
    /// once the op knows what the graph tracks ([`Self::tracking`]): a
    /// linear layer with a frozen weight makes no `dW` and so needs not
    /// its input `x`.
    fn keeps_input(&self, _index: usize) -> bool {
        true
    }

    /// The op, told before its forward pass which inputs the autodiff graph
    /// tracks (will want a gradient of): an op that makes its gradients in
    /// the forward pass (the LM head's loss) keeps this; off the graph,
    /// all false. A tensor made by tracked ops tracks too, though burn's
    /// `is_require_grad` says so only of a leaf.
    fn tracking(self, _tracked: [bool; N]) -> Self {
        self
    }

    /// The output and what to save.
    fn forward(&self, inputs: [HostTensor<'_>; N]) -> HostOutput;

    /// The gradient of every input (same shapes as the inputs), given the
    /// inputs, the forward output, what it saved, and `d_out`; an input
    /// that is not `needed` (off the graph: a frozen weight) may get an
    /// empty vector instead.
    fn backward(
        &self,
        inputs: [HostTensor<'_>; N],
        output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        needed: [bool; N],
    ) -> [Vec<f32>; N];

    /// Whether the backward pass adds its gradients into the ones the graph
    /// holds already for its inputs ([`Self::backward_adding`]), taken out
    /// of burn's container, rather than returning fresh ones for burn to
    /// add: the embedding table tied to the LM head, whose `[V, C]`
    /// gradient the head registered first, while the lookup's own touches
    /// only the batch's rows. burn's sum held two `[V, C]` buffers at once
    /// at the end of every backward pass, the step's peak (SmolLM2-135M:
    /// 108 MiB). Kept ops only (not [`Self::RECOMPUTE`]).
    const ADDS_INTO_REGISTERED: bool = false;

    /// The backward pass of an op with [`Self::ADDS_INTO_REGISTERED`]
    /// (which reads neither its output nor saved values): `registered[i]`
    /// is input `i`'s gradient so far (`None` where there is none yet);
    /// each gradient returned has it added as burn adds (this op's + the
    /// registered one).
    fn backward_adding(
        &self,
        _inputs: [HostTensor<'_>; N],
        _d_out: &[f32],
        _registered: [Option<Vec<f32>>; N],
    ) -> [Vec<f32>; N] {
        unreachable!("only an op that adds into registered gradients is asked to")
    }

    /// [`Self::backward`] with what the forward pass saved handed over
    /// (the graph's only holder of it: a plain backward pass), for an op
    /// whose gradients are its saved values and can be returned in their
    /// buffers.
    fn backward_owned(
        &self,
        inputs: [HostTensor<'_>; N],
        output: &[f32],
        saved: Vec<f32>,
        d_out: &[f32],
        needed: [bool; N],
    ) -> [Vec<f32>; N] {
        self.backward(inputs, output, &saved, d_out, needed)
    }
}

/// The backend primitives of `inputs` on backend `$backend`.
macro_rules! primitives {
    ($inputs:expr, $backend:ty) => {{
        let mut converted = Vec::with_capacity(N);
        for tensor in $inputs {
            converted.push(
                tensor
                    .try_into_primitive::<$backend>()
                    .map_err(|err| UnsupportedTensor(format!("{err:?}")))?,
            );
        }
        <[_; N]>::try_from(converted)
            .map_err(|_| UnsupportedTensor("input count changed".into()))?
    }};
}

/// Runs `op` on tensors of one rank `I`, giving a tensor of rank `O`;
/// differentiable when the inputs are on an autodiff device.
pub(crate) fn apply<Op: HostOp<N>, const N: usize, const I: usize, const O: usize>(
    op: Op,
    inputs: [Tensor<I>; N],
) -> Result<Tensor<O>, UnsupportedTensor> {
    if !inputs.iter().all(Tensor::is_autodiff) {
        let inputs: [FlexTensor; N] = primitives!(inputs, Flex);
        let (output, _) = forward(&op.tracking([false; N]), &inputs)?;
        return Ok(Tensor::from_primitive::<Flex>(output));
    }
    let strategy = inputs[0].gradient_checkpointing_strategy();
    match strategy {
        Some(GradientCheckpointingStrategy::Balanced) => {
            type Backend = Autodiff<Flex, BalancedCheckpointing>;
            let inputs = primitives!(inputs, Backend);
            let output = tracked::<_, BalancedCheckpointing, N>(op, inputs)?;
            Ok(Tensor::from_primitive::<Backend>(output))
        }
        _ => {
            type Backend = Autodiff<Flex, NoCheckpointing>;
            let inputs = primitives!(inputs, Backend);
            let output = tracked::<_, NoCheckpointing, N>(op, inputs)?;
            Ok(Tensor::from_primitive::<Backend>(output))
        }
    }
}

/// The values of a contiguous f32 tensor.
fn f32_values(tensor: &FlexTensor) -> Result<&[f32], UnsupportedTensor> {
    tensor.as_slice::<f32>().ok_or_else(|| {
        UnsupportedTensor(format!(
            "fused kernels take contiguous f32 tensors, got {:?}",
            tensor.dtype()
        ))
    })
}

/// Contiguous copies (or the tensors themselves) and their shapes.
fn contiguous<const N: usize>(inputs: &[FlexTensor; N]) -> ([FlexTensor; N], [Vec<usize>; N]) {
    (
        inputs.each_ref().map(FlexTensor::to_contiguous),
        inputs.each_ref().map(|t| t.layout().shape().to_vec()),
    )
}

fn host_views<'a, const N: usize>(
    tensors: &'a [FlexTensor; N],
    shapes: &'a [Vec<usize>; N],
) -> Result<[HostTensor<'a>; N], UnsupportedTensor> {
    let mut views = Vec::with_capacity(N);
    for (tensor, shape) in tensors.iter().zip(shapes) {
        views.push(HostTensor {
            values: f32_values(tensor)?,
            shape,
        });
    }
    views
        .try_into()
        .map_err(|_| UnsupportedTensor("input count changed".into()))
}

fn forward<Op: HostOp<N>, const N: usize>(
    op: &Op,
    inputs: &[FlexTensor; N],
) -> Result<(FlexTensor, Vec<f32>), UnsupportedTensor> {
    let (tensors, shapes) = contiguous(inputs);
    let HostOutput {
        values,
        shape,
        saved,
    } = op.forward(host_views(&tensors, &shapes)?);
    Ok((FlexTensor::from_data(TensorData::new(values, shape)), saved))
}

/// What the backward pass keeps: the inputs, the output and the op's own
/// saved values.
#[derive(Debug, Clone)]
struct Saved<Op, const N: usize> {
    op: Op,
    inputs: [FlexTensor; N],
    /// The inputs' shapes, also when their values are not kept.
    shapes: [Vec<usize>; N],
    output: FlexTensor,
    saved: Arc<Vec<f32>>,
    /// The inputs as the graph knows them, for an op that adds into their
    /// registered gradients ([`HostOp::ADDS_INTO_REGISTERED`]): burn takes
    /// a gradient out of its container by the tensor, not by the node.
    leaves: Option<[FloatTensor<Autodiff<Flex>>; N]>,
}

impl<Op: HostOp<N>, const N: usize> Backward<Flex, N> for HostBackwardOf<Op, N> {
    type State = Saved<Op, N>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<Flex>(&ops.node).to_contiguous();
        let state = ops.state;
        let (tensors, _) = contiguous(&state.inputs);
        let shapes = state.shapes;
        let output = state.output.to_contiguous();
        // The forward pass checked every one of these: a failure is a bug.
        let (Ok(inputs), Ok(output_values), Ok(d_out_values)) = (
            host_views(&tensors, &shapes),
            f32_values(&output),
            f32_values(&d_out),
        ) else {
            panic!("fused kernel backward: tensors are no longer contiguous f32");
        };
        let needed = ops.parents.each_ref().map(Option::is_some);
        if let Some(leaves) = &state.leaves {
            let registered = leaves
                .each_ref()
                .map(|leaf| grads.remove::<Flex>(leaf).map(owned_values));
            let gradients = state.op.backward_adding(inputs, d_out_values, registered);
            register(
                grads,
                ops.parents.map(|p| p.map(|node| node.id)),
                gradients,
                shapes,
            );
            return;
        }
        let gradients = match Arc::try_unwrap(state.saved) {
            Ok(saved) => {
                state
                    .op
                    .backward_owned(inputs, output_values, saved, d_out_values, needed)
            }
            Err(shared) => state
                .op
                .backward(inputs, output_values, &shared, d_out_values, needed),
        };
        register(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            gradients,
            shapes,
        );
    }
}

/// Whether the graph tracks the tensor of `node`: burn keeps a node's
/// requirement to itself, so a one-input op is prepared on it (and dropped
/// before it registers anything) to read whether burn would track it.
fn is_tracked(node: NodeGuard) -> bool {
    matches!(
        TrackingProbe
            .prepare::<NoCheckpointing>([node])
            .compute_bound()
            .stateful(),
        OpsKind::Tracked(_)
    )
}

/// [`is_tracked`]'s op: never finished, so never run backward.
#[derive(Debug)]
struct TrackingProbe;

impl Backward<Flex, 1> for TrackingProbe {
    type State = ();

    fn backward(self, _: Ops<(), 1>, _: &mut Gradients, _: &mut Checkpointer) {
        unreachable!("the tracking probe is never registered in a graph")
    }
}

/// The backward step of `Op` (a marker: burn wants the step itself stateless).
#[derive(Debug)]
struct HostBackwardOf<Op, const N: usize>(std::marker::PhantomData<Op>);

fn tracked<Op: HostOp<N>, C: CheckpointStrategy, const N: usize>(
    op: Op,
    inputs: [FloatTensor<Autodiff<Flex>>; N],
) -> Result<FloatTensor<Autodiff<Flex>>, UnsupportedTensor> {
    let op = op.tracking(inputs.each_ref().map(|t| is_tracked(t.node())));
    if Op::RECOMPUTE {
        return recomputed::<Op, C, N>(op, inputs);
    }
    let leaves = Op::ADDS_INTO_REGISTERED.then(|| inputs.clone());
    let parts = inputs.map(|t| t.into_parts());
    let mut primitives = Vec::with_capacity(N);
    let mut nodes = Vec::with_capacity(N);
    for (primitive, node) in parts {
        primitives.push(primitive);
        nodes.push(node);
    }
    let (Ok(primitives), Ok(nodes)) = (
        <[FlexTensor; N]>::try_from(primitives),
        <[_; N]>::try_from(nodes),
    ) else {
        return Err(UnsupportedTensor("input count changed".into()));
    };
    let (output, saved) = forward(&op, &primitives)?;
    let keeps: [bool; N] = std::array::from_fn(|i| Op::KEEPS_INPUTS && op.keeps_input(i));
    // Compute-bound: gradient checkpointing keeps the output rather than
    // running the kernel again.
    Ok(
        match HostBackwardOf::<Op, N>(std::marker::PhantomData)
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    op,
                    shapes: primitives.each_ref().map(|t| t.layout().shape().to_vec()),
                    inputs: {
                        let mut keeps = keeps.into_iter();
                        primitives.map(|tensor| {
                            if keeps.next().unwrap_or(true) {
                                tensor
                            } else {
                                FlexTensor::from_data(TensorData::new(Vec::<f32>::new(), [0]))
                            }
                        })
                    },
                    output: if Op::KEEPS_OUTPUT {
                        output.clone()
                    } else {
                        FlexTensor::from_data(TensorData::new(Vec::<f32>::new(), [0]))
                    },
                    saved: Arc::new(saved),
                    leaves,
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    )
}

/// The memory-bound path: the graph keeps the inputs (through burn's
/// checkpointer, which may recompute them) and the backward pass runs the
/// forward kernel again for the output and saved values.
fn recomputed<Op: HostOp<N>, C: CheckpointStrategy, const N: usize>(
    op: Op,
    inputs: [FloatTensor<Autodiff<Flex>>; N],
) -> Result<FloatTensor<Autodiff<Flex>>, UnsupportedTensor> {
    let primitives = inputs.each_ref().map(|t| t.primitive().clone());
    let (output, _) = forward(&op, &primitives)?;
    let nodes = inputs.each_ref().map(|t| t.node());
    let retro = RetroHostOp {
        op: op.clone(),
        inputs: inputs.each_ref().map(|t| t.id()),
    };
    Ok(
        match RecomputedBackwardOf::<Op, N>(std::marker::PhantomData)
            .prepare::<C>(nodes)
            .memory_bound()
            .retro_forward(retro)
            .parents(inputs.iter())
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let ids = inputs.each_ref().map(|t| prep.checkpoint(t));
                prep.finish((op, ids), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    )
}

/// Recomputes the output of a memory-bound op when gradient checkpointing
/// dropped it and a later op's backward pass asks for it.
#[derive(Debug)]
struct RetroHostOp<Op, const N: usize> {
    op: Op,
    inputs: [NodeId; N],
}

impl<Op: HostOp<N>, const N: usize> RetroForward for RetroHostOp<Op, N> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let inputs = self.inputs.map(|id| states.get_state::<FlexTensor>(&id));
        // The first forward pass ran on these very tensors: a failure is a bug.
        let Ok((output, _)) = forward(&self.op, &inputs) else {
            panic!("fused kernel recompute: tensors are no longer contiguous f32");
        };
        states.save(out_node, output);
    }
}

/// The backward step of a memory-bound `Op`.
#[derive(Debug)]
struct RecomputedBackwardOf<Op, const N: usize>(std::marker::PhantomData<Op>);

impl<Op: HostOp<N>, const N: usize> Backward<Flex, N> for RecomputedBackwardOf<Op, N> {
    type State = (Op, [NodeId; N]);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (op, ids) = ops.state;
        let inputs = ids.map(|id| checkpointer.retrieve_node_output::<FlexTensor>(id));
        let d_out = grads.consume::<Flex>(&ops.node).to_contiguous();
        let (tensors, shapes) = contiguous(&inputs);
        // The first forward pass ran on these very tensors: a failure is a bug.
        let (Ok(views), Ok(d_out_values)) = (host_views(&tensors, &shapes), f32_values(&d_out))
        else {
            panic!("fused kernel backward: tensors are no longer contiguous f32");
        };
        let recomputed = op.forward(views);
        let needed = ops.parents.each_ref().map(Option::is_some);
        let gradients = op.backward(
            views,
            &recomputed.values,
            &recomputed.saved,
            d_out_values,
            needed,
        );
        register(
            grads,
            ops.parents.map(|p| p.map(|node| node.id)),
            gradients,
            shapes,
        );
    }
}

/// A gradient taken out of burn's container as a `Vec`: its buffer when
/// the tensor is that buffer's only holder (a kernel's output), a copy
/// otherwise.
fn owned_values(tensor: FlexTensor) -> Vec<f32> {
    tensor
        .into_data()
        .try_into_vec::<f32>()
        .unwrap_or_else(|_| panic!("fused kernel backward: a registered gradient is not f32"))
}

/// Hands every tracked parent its gradient.
fn register<const N: usize>(
    grads: &mut Gradients,
    parents: [Option<NodeId>; N],
    gradients: [Vec<f32>; N],
    shapes: [Vec<usize>; N],
) {
    for ((parent, gradient), shape) in parents.into_iter().zip(gradients).zip(shapes) {
        if let Some(id) = parent {
            let gradient = FlexTensor::from_data(TensorData::new(gradient, shape));
            grads.register::<Flex>(id, gradient);
        }
    }
}
