import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import hetshard_models as models
from hetshard.cluster import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration, Efficiency
from hetshard.cost.comm import collective_time, p2p_time, topology
from hetshard.cost.stage import stage_cost
from hetshard.errors import SpecError
from hetshard.remat import REMATS
from hetshard.rewrite.pipeline import remat_wrap, split_stages
from hetshard_models import profile as profile_model
from hetshard_models.steps import example_batch, loss_of

CAL = Calibration(default=Efficiency(comm_eff=0.5, intra_latency_s=1e-5,
                                     inter_latency_s=2e-5))


def test_all_reduce_inside_a_node():
    c = Cluster.load("dgx-a100-80gb-x16")
    topo = topology(c, range(8))
    assert (topo.n, topo.nodes, topo.per_node) == (8, 1, 8)
    # Ring: 2(n-1)/n * S / (300 GB/s * 0.5) + 2(n-1) latencies.
    want = 2 * 7 / 8 * 1e9 / 150e9 + 14 * 1e-5
    assert collective_time("all_reduce", 1e9, topo, CAL, "A100-80GB") == pytest.approx(want)
    half = 7 / 8 * 1e9 / 150e9 + 7 * 1e-5
    assert collective_time("all_gather", 1e9, topo, CAL, "A100-80GB") == pytest.approx(half)
    assert collective_time("reduce_scatter", 1e9, topo, CAL, "A100-80GB") == pytest.approx(half)
    assert collective_time("all_reduce", 1e9, topology(c, [3]), CAL, "A100-80GB") == 0.0


def test_all_reduce_across_nodes_is_hierarchical():
    c = Cluster.load("dgx-a100-80gb-x16")
    topo = topology(c, range(16))
    assert (topo.nodes, topo.per_node, topo.inter_gbs) == (2, 8, 200)
    assert topo.fabric.name == "infiniband"
    # Inside the nodes at 300 GB/s * comm_eff; across them each node's 1/8 shards over
    # its 200 GB/s at InfiniBand's share for a 1 GB buffer (0.94 of line rate, half of
    # it at 2 MiB); the two pipelined, latencies added (2 tree steps across 2 nodes).
    share = 0.94 * 1e9 / (1e9 + 2 * 2**20)
    intra = 2 * 7 / 8 * 1e9 / 150e9
    inter = 2 * 1 / 2 * 1e9 / (200e9 * share)
    want = max(intra, inter) + 14 * 1e-5 + 2 * 2e-5
    assert collective_time("all_reduce", 1e9, topo, CAL, "A100-80GB") == pytest.approx(want)


def test_p2p_uses_the_right_link():
    c = Cluster.load("a100-v100")
    same_node = p2p_time(1e9, c, [0, 1], [2, 3], CAL)
    assert same_node == pytest.approx(1e9 / 2 / 150e9 + 1e-5)
    share = 0.94 * 1e9 / (1e9 + 2 * 2**20)  # InfiniBand's, between nodes and groups
    across_nodes = p2p_time(1e9, c, [0], [8], CAL)
    assert across_nodes == pytest.approx(1e9 / (200e9 * share) + 2e-5)
    across_groups = p2p_time(1e9, c, [0], [16], CAL)
    assert across_groups == pytest.approx(1e9 / (12.5e9 * share) + 2e-5)
    with pytest.raises(SpecError, match="collective"):
        collective_time("broadcast", 1.0, topology(c, [0, 1]), CAL, "A100-80GB")


SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"


@pytest.fixture(scope="module")
def prof():
    return profile_model(SPEC, 32, "float32")


def test_memory_model_matches_hand_computed_totals(prof):
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    n_params = models.resolve(SPEC).num_params()
    copies = sum(layer.weight_copy_bytes for layer in prof.layers)
    base = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, cal=DEFAULT,
                      attention="reference")
    # fp32 parameters + fp32 gradients (8 bytes per parameter) + AdamW's state: two fp32
    # moments per parameter (its scalar step counters are ignored).
    state = jax.eval_shape(optax.adamw(1e-4).init,
                           {"w": jax.ShapeDtypeStruct((n_params,), jnp.float32)})
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.shape)
    assert opt_bytes == 8 * n_params
    assert base.memory_static_bytes - copies == pytest.approx(8 * n_params + opt_bytes,
                                                              rel=1e-9)
    # Without remat: what XLA writes when forward and backward are one program.
    kept = sum(layer.fused_residual_bytes_per_sample for layer in prof.layers)
    assert 0 < kept < sum(layer.residual_bytes_per_sample for layer in prof.layers)
    assert base.memory_per_microbatch_bytes == pytest.approx(2 * kept)
    fsdp = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, dp=4, fsdp=True, cal=DEFAULT,
                      attention="reference")
    assert fsdp.memory_static_bytes == pytest.approx(base.memory_static_bytes / 4)
    # ZeRO-1: the optimizer's moments (and their update) split 4 ways, nothing else.
    zero1 = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, dp=4, shard_optimizer=True,
                       cal=DEFAULT, attention="reference")
    assert base.memory_static_bytes - zero1.memory_static_bytes == \
        pytest.approx(opt_bytes * 3 / 4, rel=1e-9)
    assert zero1.optimizer_s == pytest.approx(base.optimizer_s / 4)
    assert (zero1.fwd_s, zero1.bwd_s, zero1.memory_per_microbatch_bytes) == \
        (base.fwd_s, base.bwd_s, base.memory_per_microbatch_bytes)
    full = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, remat="full", cal=DEFAULT)
    # Full remat keeps each layer's input, the layer before's output ([seq=32, hidden=64]
    # float32 per sample after the embedding and each block; the token ids before it).
    blocks = [layer for layer in prof.layers if layer.block]
    kept = sum(layer.boundary_bytes_per_sample for layer in prof.layers[:-1]) * 2
    assert full.memory_per_microbatch_bytes == pytest.approx(kept)
    assert blocks[0].boundary_bytes_per_sample == 32 * 64 * 4
    sel = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, remat="selective", cal=DEFAULT)
    none = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, cal=DEFAULT)
    # Selective keeps the matmuls' outputs (checked against JAX's own residuals below):
    # between full and none in memory and in time.
    assert full.memory_per_microbatch_bytes < sel.memory_per_microbatch_bytes < \
        none.memory_per_microbatch_bytes
    assert full.bwd_s > sel.bwd_s > none.bwd_s
    assert full.hardware_flops > full.model_flops == base.model_flops


def _vjp_residual_bytes(spec, layers, samples, remat, count=None):
    """Bytes of the residuals ``jax.vjp`` keeps for a pipeline stage's forward program
    of ``spec`` with ``layers`` blocks, as the runtime builds it (flash kernel, the
    remat's checkpoint per layer, remat none's included); shapes only, nothing
    computed. ``count``: the remat's first layers only (remat none's policy on the
    rest)."""
    config = dataclasses.replace(models.resolve(spec), layers=layers)
    graphdef, state = nnx.split(models.abstract(config))
    leaves, tree = jax.tree.flatten(state)
    batch, btree = jax.tree.flatten(example_batch(config, samples, 32))

    def loss(sl, bl):
        return loss_of(config)(nnx.merge(graphdef, jax.tree.unflatten(tree, sl)),
                               jax.tree.unflatten(btree, bl))
    split = split_stages(loss, leaves, batch, [(0, layers + 2)], list(range(len(leaves))),
                         attention="flash", interpret=True)
    st, wrap = split.stages[0], remat_wrap(remat, checkpoint_none=True)
    vjp = jax.eval_shape(
        lambda p, f, b: st.forward(p, f, b, [], (wrap, count))[2],
        [leaves[i] for i in st.params], [leaves[i] for i in st.frozen],
        [batch[i] for i in st.batch])
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp))


@pytest.mark.parametrize("spec", [
    SPEC,
    "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32,mlp=swiglu,norm=rmsnorm,pos=rope,"
    "tied=false,bias=false,dtype=bfloat16"])
@pytest.mark.parametrize("remat", REMATS)
def test_activation_memory_is_what_the_runtimes_vjp_keeps(spec, remat):
    # One more block and one more sample: the residuals jax.vjp keeps for them, under the
    # runtime's checkpoint policy, against the model's activation bytes for one block.
    r = {(n, b): _vjp_residual_bytes(spec, n, b, remat) for n in (2, 3) for b in (1, 2)}
    measured = (r[3, 2] - r[3, 1]) - (r[2, 2] - r[2, 1])
    prof = profile_model(spec, 32, "bfloat16" if "bfloat16" in spec else "float32")
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    block = stage_cost(prof, 2, 3, gpu, mbs=1, remat=remat, cal=DEFAULT)
    # Without remat attention's part is the flash kernel's (q, k, v and its output in
    # its layout, log-sum-exp, positions), not the reference attention's.
    assert block.memory_per_microbatch_bytes == pytest.approx(measured, rel=0.01)


def test_partial_remat_prices_the_first_layers_full_and_the_rest_none(prof):
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    n = prof.num_layers

    def cost(remat="full", k=None, a=0, b=n):
        return stage_cost(prof, a, b, gpu, mbs=2, remat=remat, remat_layers=k, cal=DEFAULT)
    none, full = cost("none"), cost()
    assert cost(k=0) == none and cost(k=n) == full
    parts = [cost(k=k) for k in range(n + 1)]
    for k in range(1, n):
        # The first k layers priced as full remat, the rest as none: sums of the two.
        head, tail = cost(a=0, b=k), cost("none", a=k, b=n)
        c = parts[k]
        assert c.bwd_s == pytest.approx(head.bwd_s + tail.bwd_s)
        assert c.memory_per_microbatch_bytes == pytest.approx(
            head.memory_per_microbatch_bytes + tail.memory_per_microbatch_bytes)
        assert c.hardware_flops == pytest.approx(head.hardware_flops + tail.hardware_flops)
        assert c.memory_static_bytes == pytest.approx(full.memory_static_bytes)
    # More layers recomputed: never faster, never more activation memory.
    for lo, hi in zip(parts, parts[1:], strict=False):
        assert hi.bwd_s >= lo.bwd_s and \
            hi.memory_per_microbatch_bytes <= lo.memory_per_microbatch_bytes
    assert parts[-1].bwd_s > parts[0].bwd_s
    with pytest.raises(SpecError, match=r"remat_layers=5.*0 to 4"):
        cost(k=5, a=0, b=4)


def test_split_blocks_profile_halves_add_up_to_the_blocks(prof):
    # Each block becomes its attention half and its MLP half: flops, parameters and
    # residuals add up to the block's, the half boundary carries the residual stream, and
    # a simulation refuses a profile of the other granularity.
    halves = profile_model(SPEC, 32, "float32", split_blocks=True)
    assert halves.split_blocks and halves.num_layers == 2 * prof.num_layers - 2
    assert halves.layer_names()[1:3] == ["decoder/layer_0/half_0", "decoder/layer_0/half_1"]
    for i, block in enumerate(prof.layers[1:-1]):
        attn, mlp = halves.layers[1 + 2 * i], halves.layers[2 + 2 * i]
        assert attn.flops(2) + mlp.flops(2) == pytest.approx(block.flops(2))
        assert attn.param_bytes + mlp.param_bytes == block.param_bytes
        assert attn.param_bytes > 0 and mlp.param_bytes > attn.param_bytes  # ffn = 4h
        assert attn.residual_bytes_per_sample + mlp.residual_bytes_per_sample == \
            pytest.approx(block.residual_bytes_per_sample)
        assert attn.boundary_bytes_per_sample == block.boundary_bytes_per_sample
        assert attn.fwd_attention.any() and not mlp.fwd_attention.any()
    # Tensor parallel: a block's two halves pay the block's two all-reduces each way
    # (one per residual branch), not two each.
    c = Cluster.load("dgx-a100-80gb-x8")
    kw = dict(mbs=4, tp=2, cal=DEFAULT, tp_topo=topology(c, [0, 1]))
    whole = stage_cost(prof, 1, 3, c.groups[0].gpu, **kw)
    split = stage_cost(halves, 1, 5, c.groups[0].gpu, **kw)
    assert split.fwd_s == pytest.approx(whole.fwd_s, rel=1e-9)
    assert split.bwd_s == pytest.approx(whole.bwd_s, rel=1e-9)
    from hetshard._plan import Pipeline, Plan, Stage
    from hetshard.sim import simulate
    stage = Stage(0, prof.num_layers, (0,), "A100-80GB", (("data", 1),))
    plan = Plan(SPEC, {}, 2, 32, (Pipeline((stage,), 2, 2, 1),))
    cluster = Cluster.load("dgx-a100-80gb-x8")
    with pytest.raises(SpecError, match=r"profile.split_blocks=True.*split_blocks=False"):
        simulate(plan, halves, cluster)
    assert simulate(plan, prof, cluster).fits


def test_tensor_parallel_divides_compute_and_adds_communication(prof):
    c = Cluster.load("dgx-a100-80gb-x8")
    gpu = c.groups[0].gpu
    one = stage_cost(prof, 1, 3, gpu, mbs=4, cal=DEFAULT)
    two = stage_cost(prof, 1, 3, gpu, mbs=4, tp=2, cal=DEFAULT, tp_topo=topology(c, [0, 1]))
    no_comm = stage_cost(prof, 1, 3, gpu, mbs=4, tp=2, cal=DEFAULT)
    assert no_comm.fwd_s < one.fwd_s and two.fwd_s > no_comm.fwd_s
    # Without solved layouts a block's matrices are split, its norm scales and biases
    # are whole on each rank (hetshard's runtime never splits them): the state scales by
    # that share; priced as runtimes that split every weight, it halves.
    from hetshard.cost.stage import tensor_rank_bytes
    layers = prof.layers[1:3]
    assert layers[0].tp_whole_bytes > 0
    share = sum(tensor_rank_bytes(x, 2, None) for x in layers) / sum(
        x.param_bytes for x in layers)
    assert 0.5 < share < 0.51
    assert two.memory_static_bytes == pytest.approx(one.memory_static_bytes * share)
    split = prof.every_weight_split()
    assert stage_cost(split, 1, 3, gpu, mbs=4, tp=2, cal=DEFAULT).memory_static_bytes == \
        pytest.approx(stage_cost(split, 1, 3, gpu, mbs=4, cal=DEFAULT).memory_static_bytes / 2)


def test_full_remat_does_not_gather_the_sequence_parallel_inputs_twice():
    """With sequence parallelism the backward gathers the column-parallel inputs again
    (half an all-reduce more than the forward's collectives); under full remat the
    recomputed forward, priced with its own collectives, has just gathered them."""
    prof = profile_model("gpt-6.7b", 2048, "bfloat16")
    assert prof.layers[1].tp_sequence % 4 == 0  # sequence-parallel at tp 4
    c = Cluster.load("dgx-a100-80gb-x8")
    gpu, topo = c.groups[0].gpu, topology(c, [0, 1, 2, 3])

    def comm(remat):
        kw = dict(mbs=1, tp=4, cal=DEFAULT, remat=remat)
        on, off = stage_cost(prof, 1, 3, gpu, tp_topo=topo, **kw), stage_cost(
            prof, 1, 3, gpu, **kw)
        return on.fwd_s - off.fwd_s, on.bwd_s - off.bwd_s

    fwd, bwd = comm("none")
    assert fwd > 0 and bwd == pytest.approx(1.5 * fwd, rel=1e-9)
    fwd, bwd = comm("full")  # the recomputed forward's collectives, then the backward's
    assert bwd == pytest.approx(2.0 * fwd, rel=1e-9)


def test_collective_matmuls_hide_tensor_parallel_collectives_behind_their_matmuls():
    prof = profile_model("gpt-6.7b", 2048, "bfloat16")
    block = prof.layers[1]
    # q, k, v before attention and the output projection after it; up, then down.
    assert block.tp_sequence == 2048
    assert [(len(col), len(row)) for col, row in block.tp_groups] == [(3, 1), (1, 1)]
    assert prof.layers[0].tp_groups == () and prof.layers[-1].tp_groups == ()
    c = Cluster.load("dgx-a100-80gb-x8")
    gpu, topo = c.groups[0].gpu, topology(c, [0, 1, 2, 3])
    quiet = Calibration(default=dataclasses.replace(DEFAULT.default,
                                                    tp_overlap_interference=1e-12))

    def cost(start=1, end=2, cal=DEFAULT, **kw):
        return stage_cost(prof, start, end, gpu, tp=4, mbs=1, cal=cal, **kw)
    base, free = cost(tp_topo=topo), cost()
    over, over_quiet = cost(tp_topo=topo, tp_overlap=True), cost(cal=quiet, tp_topo=topo,
                                                                 tp_overlap=True)
    # NVLink on an A100 hides most of a 6.7B block's collectives behind its matmuls; what
    # is hidden still slows them (tp_overlap_interference).
    assert free.fwd_s < over_quiet.fwd_s < over.fwd_s < base.fwd_s
    assert over_quiet.fwd_s - free.fwd_s < 0.2 * (base.fwd_s - free.fwd_s)
    # Backward: a column group's two rings behind matmuls of the forward's size, a row
    # matmul's one ring behind twice its forward matmul; the column groups' second
    # ring belongs to ZB-H1's W pass, the row matmuls' weight gradients move to B.
    assert free.bwd_s < over_quiet.bwd_s <= free.bwd_s + 2 * (over_quiet.fwd_s - free.fwd_s)
    assert over_quiet.bwd_weight_s < free.bwd_weight_s
    assert free.bwd_s < over.bwd_s < base.bwd_s
    # Without overlap the backward gathers the column inputs again (sequence
    # parallelism keeps them split): 1.5 all-reduces per collective instead of 1.
    ar = collective_time("all_reduce", block.boundary_bytes_per_sample, topo, DEFAULT,
                         gpu.name)
    assert base.fwd_s - free.fwd_s == pytest.approx(2 * ar, rel=1e-9)
    assert base.bwd_s - free.bwd_s == pytest.approx(3 * ar, rel=1e-9)
    # A link too slow to hide anything: the collective matmuls cost what the plain
    # collectives cost, never more.
    slow = Calibration(default=dataclasses.replace(DEFAULT.default, comm_eff=1e-3,
                                                   tp_overlap_interference=1e-12))
    base, over = cost(cal=slow, tp_topo=topo), cost(cal=slow, tp_topo=topo, tp_overlap=True)
    assert over.fwd_s == pytest.approx(base.fwd_s, rel=1e-2) and over.fwd_s <= base.fwd_s
    assert over.bwd_s == pytest.approx(base.bwd_s, rel=1e-2) and over.bwd_s <= base.bwd_s
    # Layers that are not blocks (embedding, head) keep their all-reduces.
    assert cost(0, 1, tp_topo=topo, tp_overlap=True).fwd_s == cost(0, 1, tp_topo=topo).fwd_s


def test_calibration_round_trip_and_errors(tmp_path):
    cal = DEFAULT.with_type("H100-80GB", dataclasses.replace(DEFAULT.default, matmul_eff=0.6))
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == dataclasses.replace(cal, source=cal.source)
    assert Calibration.load(path).for_type("H100-80GB").matmul_eff == 0.6
    path.write_text('{"version": 1, "default": {"matmul_eff": -1}}')
    with pytest.raises(SpecError, match="matmul_eff=-1"):
        Calibration.load(path)
    path.write_text('{"version": 3}')
    with pytest.raises(SpecError, match="version"):
        Calibration.load(path)


def test_profile_command_writes_a_loadable_calibration(tmp_path):
    from hetshard.cli import main
    out = tmp_path / "cal.json"
    assert main(["profile", "--quick", "--out", str(out)]) == 0
    cal = Calibration.load(out)
    (name, eff), = cal.per_type
    assert name == "CPU" and eff.matmul_eff > 0 and eff.memory_eff > 0 and eff.comm_eff > 0
    assert eff.attention_eff is not None and eff.attention_eff > 0  # timed, not assumed
    assert "cpu" in cal.source.lower()


def test_attention_efficiency_prices_attention_equations_only(prof):
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    layer = prof.layers[1]
    assert layer.fwd_attention.any() and layer.bwd_attention.any()
    assert not layer.fwd_attention.all() and not layer.bwd_attention.all()

    def cost(attention_eff, **kw):
        eff = dataclasses.replace(DEFAULT.default, attention_eff=attention_eff)
        return stage_cost(prof, 0, prof.num_layers, gpu, mbs=8, cal=DEFAULT.with_type(
            gpu.name, eff), attention="reference", **kw)
    base, same = cost(None), cost(DEFAULT.default.matmul(gpu))
    assert (base.fwd_s, base.bwd_s) == (same.fwd_s, same.bwd_s)
    # Slow enough that attention's products are compute-bound at these tiny shapes (the
    # A100 prices float32 matmuls at its TF32 peak).
    slow = cost(DEFAULT.default.matmul(gpu) / 100)
    assert slow.fwd_s > base.fwd_s and slow.bwd_s > base.bwd_s
    assert slow.model_flops == base.model_flops  # only time changes
    assert slow.memory_static_bytes == base.memory_static_bytes
    with pytest.raises(SpecError, match="attention_eff"):
        dataclasses.replace(DEFAULT.default, attention_eff=0.0)


def test_weight_gradient_ops_and_their_share_of_the_backward(prof):
    # ZB-H1's W pass: in a block, exactly one backward matmul per weight matmul of the
    # forward (attention's matmuls have no weights); the tied head's dW counts, and the
    # embedding's whole backward is W (nothing earlier waits for it).
    profile = prof
    block, head, embed = profile.layers[1], profile.layers[-1], profile.layers[0]
    weights = int((block.fwd_matmul & ~block.fwd_attention).sum())
    assert weights >= 4
    assert int((block.bwd_weight & block.bwd_matmul).sum()) == weights
    assert not (block.bwd_weight & block.bwd_attention).any()
    assert int((head.bwd_weight & head.bwd_matmul).sum()) == 1
    assert embed.bwd_weight.all()
    gpu = Cluster.load("dgx-a100-80gb-x64").groups[0].gpu
    for remat in ("none", "full"):
        c = stage_cost(profile, 1, 3, gpu, mbs=2, remat=remat, cal=DEFAULT)
        assert 0 < c.bwd_weight_s < c.bwd_s
        assert c.memory_carry_bytes > 0
    plain, full = (stage_cost(profile, 1, 3, gpu, mbs=2, remat=r, cal=DEFAULT)
                   for r in ("none", "full"))
    # Under full remat W reads the matmul inputs B recomputed: kept until W.
    assert full.memory_carry_bytes > plain.memory_carry_bytes
    # The cotangent a stage receives is its last layer's output (none after the head).
    assert plain.memory_cotangent_bytes == pytest.approx(
        profile.layers[2].boundary_bytes_per_sample * 2)
    last = stage_cost(profile, 3, profile.num_layers, gpu, mbs=2, cal=DEFAULT)
    assert last.memory_cotangent_bytes == 0.0
    assert full.bwd_weight_s == pytest.approx(plain.bwd_weight_s)


# ---- memory as the runtime holds it (issue 49) ------------------------------------------

SWIGLU = ("gpt:layers=2,hidden=64,heads=4,kv_heads=2,ffn=192,vocab=128,seq=32,pos=rope,"
          "norm=rmsnorm,mlp=swiglu,tied=false")


def _graph(spec):
    import numpy as np

    import hetshard
    from hetshard.ir.program import reduced_graph
    from hetshard_models import data, losses
    model = models.build(spec, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = data.text_batch(np.random.default_rng(0), 2, 32, 128)

    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
        optimizer.update(model, grads)
        return loss
    return reduced_graph(hetshard.Program(step, (model, opt, batch)), 2)[0]


def test_one_program_keeps_a_swiglus_projections_not_its_activations():
    """Forward and backward in one program, XLA recomputes elementwise values inside the
    backward's kernels: a SwiGLU block keeps its gate and up projections' outputs and
    their product (the down projection's input), not the sigmoid or the SiLU that
    ``jax.vjp`` keeps; attention keeps its softmax output in both."""
    g = _graph(SWIGLU)
    vjp, _ = g.residuals(fused=False)
    one, _ = g.residuals(fused=True)
    layer = "decoder/layer_0"
    ops = g.ops

    def mine(kept, prim):
        return [i for i in kept if ops[i].layer == layer and ops[i].primitive == prim]
    assert mine(vjp, "logistic") and not mine(one, "logistic")
    ffn = [i for i in one if ops[i].layer == layer and ops[i].out_shapes[0][-1] == 192]
    assert sorted(ops[i].primitive for i in ffn) == ["dot_general", "dot_general", "mul"]
    probs = [i for i in vjp if ops[i].layer == layer and ops[i].region and
             len(ops[i].out_shapes[0]) == 5 and ops[i].out_shapes[0][-1] == 32]
    assert probs and all(i in one for i in probs)
    assert set(one) - set(vjp) <= {i for i in one if ops[i].phase == "fwd"}
    assert sum(one[i] for i in mine(one, "dot_general")) > 0
    assert sum(one.values()) < 0.8 * sum(vjp.values())
    # priced: what one program keeps, which a pipeline stage's checkpointed layers keep
    # too (test_activation_memory_is_what_the_runtimes_vjp_keeps)
    prof = profile_model(SWIGLU, 32, "float32")
    block = prof.layers[1]
    assert 0 < block.fused_residual_bytes_per_sample < block.residual_bytes_per_sample
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    c = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, attention="reference",
                   cal=DEFAULT)
    fused = sum(layer.fused_residual_bytes_per_sample for layer in prof.layers) * 2
    assert c.memory_per_microbatch_bytes == pytest.approx(fused)


def test_fsdp_prices_the_gathered_weights_and_the_whole_gradient_bucket():
    """An FSDP stage's backward gathers each layer's weights again, with or without
    remat (the runtime checkpoints its layers), two layers at a time. Its gradients are
    whole until their reduce-scatter: the largest bucket."""
    from hetshard.cost.comm import buckets
    prof = profile_model(SPEC, 32, "float32")
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    dp = 8
    kw = dict(mbs=2, dp=dp, cal=DEFAULT)

    def cost(remat, fsdp):
        return stage_cost(prof, 0, prof.num_layers, gpu, remat=remat, fsdp=fsdp, **kw)
    layers = [layer.param_bytes for layer in prof.layers]
    bucket = max(b for _, b in buckets(layers[::-1]))
    for remat, kept in (("none", 2 * max(layers)), ("full", 2 * max(layers))):
        extra = cost(remat, True).memory_working_bytes - \
            cost(remat, False).memory_working_bytes
        assert extra == pytest.approx((kept + bucket) * (1 - 1 / dp))
    # the state the update rewrites: parameters and optimizer state, sharded
    plain, sharded = cost("none", False), cost("none", True)
    assert sharded.memory_state_bytes == pytest.approx(plain.memory_state_bytes / dp)
    assert plain.memory_state_bytes == pytest.approx(
        sum(layers) * (1 + prof.opt_bytes_per_param_byte))


@pytest.mark.parametrize("remat,count", [("none", None), ("full", 2), ("selective", 3)])
def test_a_pipeline_stages_residuals_are_priced_whole_and_partial_remat(remat, count):
    """A whole stage (embedding, 3 blocks, head) as the runtime's pipeline runs it: the
    layers a partial remat leaves are checkpointed by remat none's policy (what XLA
    writes in one program), so the price of the stage's activations per sample is what
    its forward's vjp keeps (within the boundary values a checkpointed layer's input
    adds)."""
    spec = ("gpt:layers=3,hidden=64,heads=4,vocab=128,seq=32,mlp=swiglu,norm=rmsnorm,"
            "pos=rope,tied=false,bias=false,dtype=bfloat16")
    prof = profile_model(spec, 32, "bfloat16")
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    c = stage_cost(prof, 0, prof.num_layers, gpu, mbs=1, remat=remat, remat_layers=count,
                   cal=DEFAULT)
    measured = _vjp_residual_bytes(spec, 3, 2, remat, count) - \
        _vjp_residual_bytes(spec, 3, 1, remat, count)
    assert c.memory_per_microbatch_bytes == pytest.approx(measured, rel=0.03)
    if remat == "none":
        # exact; the elementwise values jax.vjp keeps unchecked are recomputed instead
        assert measured == c.memory_per_microbatch_bytes
        assert measured < 0.6 * sum(x.residual_bytes_per_sample for x in prof.layers)
