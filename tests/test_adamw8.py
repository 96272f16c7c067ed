"""train.optimizer_states="8bit": the moment codes, the Triton kernel against the torch ops, training against float32,
resume, FSDP2 shards, bad settings."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from launch_utils import run_ranks
from test_precision import STEPS, mlp, teacher_data, train_mlp
from triton_script import DEVICES, run_triton_script

from workbench.config import ConfigError, LoraConfig, RunConfig, TrainConfig
from workbench.kernels.adamw8 import decode_moments, encode_moments, quant_block, scale_shape
from workbench.kernels.stochastic_round import random_bits, sr_key
from workbench.train import finetune
from workbench.train.checkpoint import list_checkpoints
from workbench.train.optim import make_adamw
from workbench.train.triton_adamw_optimizer import TritonAdamW

# ---------------------------------------------------------------- the format


def test_quant_blocks_follow_the_rows():
    assert quant_block((32, 2880)) == 64  # gpt-oss hidden size: 2880 = 45 * 64
    assert quant_block((128, 2048, 768)) == 256
    assert quant_block((64, 96)) == 32
    assert quant_block((4096,)) == 0  # 1-D: norms and biases keep full moments
    assert quant_block((100, 100)) == 0  # rows not a multiple of 32
    assert quant_block((8, 64)) == 0  # under MIN_8BIT_NUMEL
    assert scale_shape((4, 6, 512), 256) == (4, 6, 2)


def _round_trip(m, v, key):
    qb = m.shape[-1]
    codes = encode_moments(m, v, random_bits(key, 0, m.numel()), qb)
    return decode_moments(*codes, qb)


def test_codes_are_unbiased_and_within_one_step():
    g = torch.Generator().manual_seed(0)
    rows, qb = 8, 256
    # magnitudes over 20 binades (exp_avg's codes reach 2**-14 of the block's largest), signs mixed
    m = torch.randn(rows, qb, generator=g) * torch.logspace(0, -6, qb)
    v = m.square() + torch.rand(rows, qb, generator=g) * 1e-9
    draws = 3000
    sum_m = torch.zeros(rows * qb, dtype=torch.float64)
    sum_v = torch.zeros(rows * qb, dtype=torch.float64)
    for d in range(draws):
        dm, dv = _round_trip(m, v, sr_key(0, d + 1, 0))
        if d == 0:
            # one draw: a neighbour on the code grid, under one part in 8 away where the code is normal
            big_m = m.abs() >= 2**-14 * m.abs().amax(1, keepdim=True)
            rel = ((dm.view(rows, qb) - m).abs() / m.abs())[big_m]
            assert rel.max() <= 0.125 + 1e-6, rel.max()
            assert bool((dm.view(rows, qb).sign() * m.sign() >= 0).all())  # no sign flips
            assert bool((dv > 0).all())  # a nonzero second moment never comes back 0
        sum_m += dm.double()
        sum_v += dv.double()
    m_flat, v_flat = m.reshape(-1).double(), v.reshape(-1).double()
    # means of the draws: near the float32 moments (the spacing of 3-bit codes is 1/8 of a binade, so one draw's
    # error is up to ~6%; the mean of 3000 within a fraction of a percent where the code is normal)
    big = (m.abs() >= 2**-12 * m.abs().amax(1, keepdim=True)).reshape(-1)
    err_m = ((sum_m / draws - m_flat).abs() / m_flat.abs())[big]
    v_max = v.amax(1, keepdim=True).expand_as(v).reshape(-1).double()
    big_v = v_flat >= 2**-28 * v_max
    err_v = ((sum_v / draws - v_flat).abs() / v_flat)[big_v]
    assert err_m.max() < 0.01, err_m.max()
    assert err_v.max() < 0.01, err_v.max()
    # under the smallest code (2**-30 of the block's largest) exp_avg_sq reads back as that code: never smaller
    tiny = v_flat < 2**-30 * v_max
    assert tiny.any() and torch.allclose(sum_v[tiny] / draws, 2**-30 * v_max[tiny])
    # rounding to nearest would be biased: exp_avg_sq's 0.1% steps round back to the old code
    one = _round_trip(m, v, sr_key(0, 1, 0))[1]
    assert (one != v.reshape(-1)).float().mean() > 0.9


def test_exact_codes_and_zeros_come_back_exactly():
    m = torch.tensor([[1.0, -0.5, 0.75, 0.0] * 16])
    v = torch.tensor([[1.0, 0.25, 2.0**-30, 0.0] * 16])
    dm, dv = _round_trip(m, v, 12345)
    assert torch.equal(dm, m.reshape(-1)) and torch.equal(dv, v.reshape(-1))
    dm, dv = _round_trip(torch.zeros(1, 64), torch.zeros(1, 64), 1)  # an all-zero block: no 0 / 0
    assert not dm.any() and not dv.any()


# ---------------------------------------------------------------- the Triton kernel

_KERNEL_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from workbench.kernels.adamw8 import quant_block, scale_shape, torch_adamw8_step_
    from workbench.kernels.adamw_args import AdamWLaunch, AdamWStep, Moments8, SRKeys, adamw_scalars
    from workbench.kernels.triton_adamw8 import triton_adamw8_step_

    device = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    # shape, dtype, sr_param, weight decay, precise, fp32_master, skip, clip coefficient, block, element base (the
    # last case's second block straddles 2**32: two high words of the hash in one program)
    cases = [
        ((3, 64, 96), torch.bfloat16, True, 0.0, False, False, False, False, 1024, 1000),
        ((40, 256), torch.float32, False, 0.1, True, False, False, True, 1024, 1000),
        ((9, 2880), torch.bfloat16, False, 0.0, False, False, True, False, 1024, 3 * 2**32 + 5),
        ((12, 384), torch.bfloat16, True, 0.01, False, True, False, True, 128, 1000),
        ((4, 1024), torch.bfloat16, True, 0.0, False, False, False, False, 1024, 2**32 - 1500),
    ]
    for shape, dtype, sr, wd, precise, master, skip, coef, block, base in cases:
        qb = quant_block(shape)
        p0 = (torch.randn(shape, generator=g) * 0.02).to(dtype).to(device)
        spread = torch.logspace(-7, 0, shape[-1])  # gradients over seven decades within each row
        grads = [(torch.randn(shape, generator=g) * spread).to(dtype).to(device) for _ in range(4)]
        results = []
        for impl in (torch_adamw8_step_, triton_adamw8_step_):
            target = p0.float() if master else p0.clone()
            out = p0.clone() if master else None
            codes = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2)]
            scales = [torch.zeros(scale_shape(shape, qb), device=device) for _ in range(2)]
            state = [codes[0], scales[0], codes[1], scales[1]]
            for step, grad in enumerate(grads, 1):
                s = adamw_scalars(step, 1e-3, 0.9, 0.999, 1e-8, wd)
                flag = torch.tensor(float(skip and step == 3), device=device) if skip else None
                c = torch.tensor(0.5, device=device) if coef else None
                # the torch ops take the launch too, and ignore it: one AdamWStep for both
                one = AdamWStep(s, precise, flag, c, AdamWLaunch(block=block))
                impl(target, grad, Moments8(*state, qb), one, SRKeys.make(7, step, 2, base), sr, out)
            results.append([target, *state] + ([out] if master else []))
        for a, b in zip(*results):
            assert torch.equal(a, b), (shape, dtype, (a.float() - b.float()).abs().max().item())
    print("ADAMW8 KERNEL OK")
""")


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_triton_8bit_kernel_equals_the_torch_ops_bit_for_bit(device):
    run_triton_script(_KERNEL_SCRIPT, device, "ADAMW8 KERNEL OK", timeout=300)


# ---------------------------------------------------------------- training against float32


@pytest.fixture(scope="module")
def data():
    return teacher_data()


@pytest.mark.slow
@pytest.mark.parametrize("lr", [1e-5, 1e-3])
def test_8bit_moments_track_the_float32_reference(data, lr):
    train_data, (x_eval, y_eval) = data
    init = train_data[0]

    def loss(ws):
        return F.cross_entropy(mlp([w.float() for w in ws], x_eval), y_eval).item()

    ref, _ = train_mlp(torch.float32, "auto", train_data, lr)
    ref_delta = torch.cat([(r - i).flatten() for r, i in zip(ref, init)]).double()
    drop = loss(init) - loss(ref)
    assert drop > 0
    out = {}
    for dtype, states in ((torch.float32, "8bit"), (torch.bfloat16, "8bit"), (torch.bfloat16, "full")):
        ws, opt = train_mlp(dtype, "auto", train_data, lr, states)
        assert opt.updates["torch8"] == (2 * STEPS if states == "8bit" else 0)  # both matrices took the 8-bit path
        delta = torch.cat([(w.double() - i.to(dtype).double()).flatten() for w, i in zip(ws, init)])
        out[(dtype, states)] = {
            "gap": (loss(ws) - loss(ref)) / drop,  # as a fraction of the reference's improvement
            "kept": (delta @ ref_delta / (ref_delta @ ref_delta)).item(),  # share of the reference's update
            "cos": F.cosine_similarity(delta, ref_delta, dim=0).item(),
        }
    print(lr, out)
    # measured: float32 weights gap -0.004 / -0.002, kept 1.004 / 1.002, cos 0.9996 / 0.999 (lr 1e-5 / 1e-3);
    # bf16 weights (bf16_sr) cos 0.958 at lr 1e-5, where full moments give the same: the SR of the weights, not
    # the codes, is what moves the direction there
    for r in out.values():
        assert abs(r["gap"]) < 0.1 and 0.9 < r["kept"] < 1.1, out
    assert out[(torch.float32, "8bit")]["cos"] > 0.99, out
    assert out[(torch.bfloat16, "8bit")]["cos"] > out[(torch.bfloat16, "full")]["cos"] - 0.02, out
    opt = train_mlp(torch.bfloat16, "auto", (init, train_data[1][:1], train_data[2][:1]), lr, "8bit")[1]
    # rounding the codes to nearest instead would freeze exp_avg_sq: not what ships
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert state["exp_avg_q8"].dtype == torch.uint8 and state["exp_avg_sq_absmax"].dtype == torch.float32


def test_small_and_1d_tensors_keep_full_moments():
    big = torch.nn.Parameter(torch.randn(64, 128))
    bias = torch.nn.Parameter(torch.randn(128))
    opt = TritonAdamW([big, bias], lr=1e-3, states="8bit", kernel="torch")
    for p in (big, bias):
        p.grad = torch.randn_like(p)
    opt.step()
    assert set(opt.state[big]) == {"step", "exp_avg_q8", "exp_avg_absmax", "exp_avg_sq_q8", "exp_avg_sq_absmax"}
    assert opt.state[bias]["exp_avg"].dtype == torch.float32
    assert opt.updates["torch8"] == 1


def test_tensors_that_share_multi_tensor_launches_keep_full_moments():
    # with the Triton kernel, tensors up to multi_tensor_numel share launches (host time): they keep full moments;
    # on CPU without the interpreter the kernel takes no tensor, so both run the torch ops
    small, big = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(128, 256))
    opt = TritonAdamW([small, big], lr=1e-3, states="8bit", kernel="triton", multi_tensor_numel=64 * 128)
    for p in (small, big):
        p.grad = torch.randn_like(p)
    opt.step()
    assert "exp_avg" in opt.state[small] and "exp_avg_q8" in opt.state[big]
    assert opt.updates["torch8"] == 1


# ---------------------------------------------------------------- checkpoints and resume


def test_state_dict_round_trip_continues_exactly_and_each_tensor_follows_its_state():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 256, dtype=torch.bfloat16) * 0.02)
    grads = [torch.randn_like(w) for _ in range(6)]

    def run(opt, gs):
        for g in gs:
            w.grad = g.clone()
            opt.step()

    start = w.detach().clone()
    opt = TritonAdamW([w], lr=1e-3, states="8bit", precision="bf16_sr", kernel="torch")
    run(opt, grads)
    whole = w.detach().clone()
    with torch.no_grad():
        w.copy_(start)
    first = TritonAdamW([w], lr=1e-3, states="8bit", precision="bf16_sr", kernel="torch")
    run(first, grads[:3])
    saved = first.state_dict()
    second = TritonAdamW([w], lr=1e-3, states="8bit", precision="bf16_sr", kernel="torch")
    second.load_state_dict(saved)
    assert second.state[w]["exp_avg_absmax"].dtype == torch.float32  # not cast to the parameter's bf16
    run(second, grads[3:])
    assert torch.equal(w.detach(), whole)
    with pytest.raises(ValueError, match="optimizer_states='8bit'"):
        TritonAdamW([w], states="full", kernel="torch").load_state_dict(saved)
    # full moments into an 8-bit optimizer: each tensor follows its own state (an 8-bit run keeps small tensors,
    # and on a GPU a LoRA run's adapters, in full moments); a resume that changes the setting is refused earlier
    full = TritonAdamW([w], lr=1e-3, kernel="torch")
    run(full, grads[:1])
    eight = TritonAdamW([w], lr=1e-3, states="8bit", kernel="torch")
    eight.load_state_dict(full.state_dict())
    run(eight, grads[1:2])
    assert "exp_avg" in eight.state[w] and eight.updates["torch"] == 1
    # 8-bit state made under another block rule (a GPU's: this tensor shares multi-tensor launches there) still
    # updates by its own scales
    small = TritonAdamW([w], lr=1e-3, states="8bit", kernel="triton", multi_tensor_numel=w.numel())
    small.load_state_dict(saved)
    run(small, grads[3:4])
    assert small.updates["torch8"] == 1


def _rc(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=5,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
        train__lr=1e-3,
        model__dtype="bfloat16",
        train__optimizer_states="8bit",
    )
    base.update(overrides)
    return RunConfig.demo(**base)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LoraConfig(rank=8, targets=("attention", "experts"))])
def test_a_run_trains_and_resumes_exactly(tmp_path, lora):
    # LoRA: the checkpoint keeps only the adapters and their (8-bit where they are large enough) moments
    full = finetune(_rc(tmp_path, run_id="full", train__checkpoint_every=3, lora=lora))
    assert full["losses"][-1] < full["losses"][0]
    ckpt = list_checkpoints(tmp_path / "runs" / "full" / "checkpoints")[0]
    resumed = finetune(_rc(tmp_path, run_id="resumed", train__resume_from=str(ckpt), lora=lora))
    assert resumed["losses"] == full["losses"][3:]  # the codes, scales and SR bits come back
    # refused before any weight is read, with the one way out (accepting the change cannot make the state readable)
    with pytest.raises(Exception, match=r"cannot change on resume: run with --set train\.optimizer_states=8bit"):
        finetune(_rc(tmp_path, run_id="other", train__optimizer_states="full", train__resume_from=str(ckpt), lora=lora))


def _two_rank_losses(rank, world, configs):
    return [finetune(RunConfig.from_dict(c))["losses"] for c in configs]


@pytest.mark.slow
def test_two_rank_dp2_ep2_run_resumes_exactly(tmp_path):
    # FSDP2 DTensor codes and scales (DCP saves and loads them sharded) beside the expert-parallel slices' plain ones
    full = _rc(tmp_path, run_id="full2", train__checkpoint_every=3)
    ckpt = tmp_path / "runs" / "full2" / "checkpoints" / "step-00000003"
    resumed = _rc(tmp_path, run_id="resumed2", train__resume_from=str(ckpt))
    r0, r1 = run_ranks(_two_rank_losses, 2, [full.to_dict(), resumed.to_dict()])
    assert r0 == r1
    full_losses, resumed_losses = r0
    assert len(full_losses) == 5 and resumed_losses == full_losses[3:]
    assert full_losses[-1] < full_losses[0]


# ---------------------------------------------------------------- FSDP2 shards


def _sharded_steps(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 75 and 45 rows over 2 ranks: uneven dim-0 shards; rows of 64 and 128 (scale blocks of 64 and 128). The
    # updates take synthetic gradients: the two layers need not chain.
    model = torch.nn.Sequential(torch.nn.Linear(64, 75, bias=False), torch.nn.Linear(128, 45, bias=False))
    model = model.bfloat16()
    grads = [torch.randn_like(p) for p in model.parameters()]
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = make_adamw(
        [{"params": list(model.parameters()), "weight_decay": 0.0}],
        "adamw",
        torch.device("cpu"),
        1e-3,
        seed=3,
        states="8bit",
    )
    for _ in range(3):
        for p, g in zip(model.parameters(), grads):
            p.grad = g if world == 1 else torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    params = [p.full_tensor() if world > 1 else p.detach().clone() for p in model.parameters()]
    scales = [opt.state[p]["exp_avg_sq_absmax"] for p in model.parameters()]
    scales = [s.full_tensor() if world > 1 else s for s in scales]
    return params, scales, opt.updates["torch8"]


@pytest.mark.slow
def test_fsdp2_shards_update_as_the_whole_tensor():
    ((whole_p, whole_s, n),) = run_ranks(_sharded_steps, 1)
    assert n == 6
    for got_p, got_s, _ in run_ranks(_sharded_steps, 2):
        # scale blocks lie inside rows and the SR bits hash global indices: shards equal the whole tensor
        assert all(torch.equal(a, b) for a, b in zip(got_p, whole_p))
        assert all(torch.equal(a, b) for a, b in zip(got_s, whole_s))


# ---------------------------------------------------------------- bad settings


def test_bad_optimizer_states_are_refused():
    with pytest.raises(ConfigError, match=r"train.optimizer_states must be one of"):
        TrainConfig(optimizer_states="4bit")
    with pytest.raises(ConfigError, match=r"needs the workbench AdamW"):
        TrainConfig(optimizer="adamw_torch", optimizer_states="8bit")
    with pytest.raises(ConfigError, match=r"train\.optimizer_states cannot change on resume"):
        TrainConfig(resume_allow_changes=("train.optimizer_states",))
    w = torch.nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="states must be one of"):
        TritonAdamW([w], states="int8")
    with pytest.raises(ValueError, match="needs the workbench AdamW"):
        make_adamw([{"params": [w]}], "adamw_torch", torch.device("cpu"), 1e-3, states="8bit")


# ---------------------------------------------------------------- compiled for the H200, on any machine


@pytest.mark.slow
@pytest.mark.parametrize("precise", [False, True])
def test_kernel_compiles_for_the_h200(precise):
    # the interpreter let a plain global through that the compiler refuses: compiled for sm_90 here, no GPU needed
    pytest.importorskip("triton")
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_adamw8 import _adamw8_kernel

    types = dict(P="*bf16", G="*bf16", MQ="*u8", MS="*fp32", VQ="*u8", VS="*fp32", OUT="*bf16", SKIP="*fp32")
    types.update(COEF="*fp32", SQ="*fp32", step_size="fp32", bc2_sqrt="fp32", key="i32")
    flags = dict(HAS_WD=True, PRECISE=precise, SR=True, HAS_OUT=True, HAS_SKIP=True, HAS_COEF=True, HAS_SQ=precise)
    flags.update(ROUND_BY_HAND=False, QB=64, BLOCK=1024)
    compiled = compile_for_h200(_adamw8_kernel, types, flags, divisible=("P", "G", "MQ", "MS", "VQ", "VS", "OUT"))
    assert compiled.asm["cubin"] and "st.global" in compiled.asm["ptx"]
