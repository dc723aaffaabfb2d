"""Train the embedded default models (target and draft): HF ``DeepseekV3ForCausalLM`` (MLA + MoE).

Data: the uint16 token arrays written by ``tokenizer.py`` (``train.npy``, ``heldout.npy``) and its
tokenizer files, all in ``--data`` (default ``.train_data``).

Recipe (both models): random windows of ``--ctx`` + 1 tokens from the training stream, next-token
cross-entropy, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warmup then cosine
decay to 10% of the peak LR, grad-norm clip 1.0, bf16 autocast on GPU (fp32 master weights), fixed
seed. Held-out loss is computed every ``--eval-every`` steps on all non-overlapping ``--ctx``-token
windows of the held-out stream; the checkpoint with the lowest held-out loss is the one saved.

Router bias (``e_score_correction_bias``): HF keeps it as a buffer and never trains it. We implement
DeepSeek-V3's auxiliary-loss-free balancing rule: after every optimizer step, for each MoE layer,
``bias += gamma * sign(mean_load - load)`` where ``load`` counts the tokens routed to each expert in
that step (``gamma`` = ``--bias-update``, 1e-3). No auxiliary loss is used.

Step count: ``--steps N`` fixes it. Without it, ``--time-budget S`` measures a few steps and one
evaluation first, then sets ``N`` so that training (evaluations included) takes about ``S`` seconds;
the model is rebuilt from the seed after that probe so the run equals a ``--steps N`` run.

Distillation (how the shipped draft was made): ``--teacher DIR`` loads a finished checkpoint of the
same vocabulary (frozen, bf16 on GPU) and trains on ``kd_alpha * CE + (1 - kd_alpha) * KL(teacher ||
student)`` (``--kd-alpha`` 0.5); held-out evaluations then also report the top-1 agreement of the
student with the teacher.

Outputs in ``--out``: ``save_pretrained`` files in bf16 (``config.json``, ``generation_config.json``,
``model.safetensors``), the tokenizer files, and ``train_log.json`` (loss curves and run facts).

Usage::

    python tools/train/train.py --which target --out /tmp/models/target --steps 2013
    python tools/train/train.py --which draft  --out /tmp/models/draft  --steps 2500 --teacher /tmp/models/target
    # CPU smoke test:  --steps 3 --batch 2 --ctx 64 --eval-every 2 --max-eval-windows 2 --device cpu
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

COMMON = dict(
    vocab_size=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rope_interleave=True,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    use_cache=True,
)

CONFIGS = {
    # ~13.7M parameters (~5.6M active per token): 5 layers, layer 0 dense, 4 MoE layers of
    # 16 routed experts (top-4) + 1 shared expert; MLA with q/kv LoRA ranks 160/128.
    "target": dict(
        COMMON,
        hidden_size=320,
        intermediate_size=1024,
        moe_intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=16,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        q_lora_rank=160,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
    ),
    # ~1.7M parameters: 2 layers, layer 0 dense, layer 1 MoE with 4 routed experts (top-2) + 1
    # shared expert; MLA without a q LoRA (q_lora_rank null), kv LoRA rank 64.
    "draft": dict(
        COMMON,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
    ),
}

DEFAULTS = {
    "target": dict(lr=2e-3, batch=32, ctx=512),
    "draft": dict(lr=3e-3, batch=32, ctx=512),
}


def log(*a):
    print(*a, flush=True)


def make_config(which: str):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**CONFIGS[which])


def build_model(cfg, attn: str, experts: str | None):
    from transformers import DeepseekV3ForCausalLM

    kw = {"attn_implementation": attn}
    if experts is not None:
        kw["experts_implementation"] = experts
    try:
        return DeepseekV3ForCausalLM._from_config(cfg, **kw)
    except TypeError:
        kw.pop("experts_implementation", None)
        return DeepseekV3ForCausalLM._from_config(cfg, **kw)


def experts_impl(model) -> str:
    return str(getattr(model.config, "_experts_implementation", "eager"))


def count_params(model):
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    # active per token: everything except the routed experts not chosen
    routed = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            routed += p.numel()
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = total - routed + n_moe * cfg.num_experts_per_tok * per_expert if n_moe > 0 else total
    return total, active


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): nudges e_score_correction_bias after each step."""

    def __init__(self, model, gamma: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = {}
        self._imb = None
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not module.training:
            return
        n_exp = module.e_score_correction_bias.numel()
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ints = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point()]
        if ints:  # the chosen expert ids (transformers returns them from the router)
            idx = ints[0].detach().reshape(-1)
        else:  # only router logits returned: redo the choice (n_group == 1, so no group mask)
            logits = outs[0].detach().float().reshape(-1, n_exp)
            k = module.top_k if hasattr(module, "top_k") else 1
            idx = torch.topk(logits.sigmoid() + module.e_score_correction_bias, k, dim=-1)[1].reshape(-1)
        c = torch.bincount(idx, minlength=n_exp).float()
        key = id(module)
        self.counts[key] = self.counts[key] + c if key in self.counts else c

    @torch.no_grad()
    def step(self):
        imb = []
        for r in self.routers:
            c = self.counts.pop(id(r), None)
            if c is None:
                continue
            imb.append(c.max() / c.mean().clamp_min(1.0))
            if self.gamma > 0:
                r.e_score_correction_bias.add_(self.gamma * torch.sign(c.mean() - c))
        if imb:
            self._imb = torch.stack(imb).mean()  # read lazily: no GPU sync per step

    @property
    def last_imbalance(self):
        return float(self._imb) if getattr(self, "_imb", None) is not None else float("nan")


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(model, lr, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed_tokens" not in n else no_decay).append(p)
    kw = {}
    if torch.cuda.is_available():
        kw["fused"] = True
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **kw,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--data", default=".train_data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds, used when --steps is not given")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-eval-windows", type=int, default=None)
    ap.add_argument("--bias-update", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--teacher", default=None, help="HF checkpoint dir to distil from (same vocabulary)")
    ap.add_argument("--kd-alpha", type=float, default=0.5, help="weight of the hard-label CE when distilling")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--experts", default="auto", help="auto (grouped_mm when it works, else eager), eager, grouped_mm")
    args = ap.parse_args(argv)

    import transformers

    d = DEFAULTS[args.which]
    batch = args.batch or d["batch"]
    ctx = args.ctx or d["ctx"]
    peak_lr = args.lr or d["lr"]
    dev = torch.device(args.device)
    use_amp = dev.type == "cuda"
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data_dir = Path(args.data)
    train_np = np.load(data_dir / "train.npy").astype(np.int64)
    held_np = np.load(data_dir / "heldout.npy").astype(np.int64)
    train_t = torch.from_numpy(train_np).to(dev)
    held_t = torch.from_numpy(held_np).to(dev)
    n_win = (held_t.numel() - 1) // ctx
    if args.max_eval_windows:
        n_win = min(n_win, args.max_eval_windows)
    ev_x = torch.stack([held_t[i * ctx : i * ctx + ctx] for i in range(n_win)])
    ev_y = torch.stack([held_t[i * ctx + 1 : i * ctx + ctx + 1] for i in range(n_win)])
    log(
        f"[{args.which}] python {sys.version.split()[0]} torch {torch.__version__} transformers "
        f"{transformers.__version__} device {dev} "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}"
    )
    log(f"[{args.which}] train tokens {train_t.numel()} heldout tokens {held_t.numel()} ({n_win} eval windows of {ctx})")

    cfg = make_config(args.which)
    V = cfg.vocab_size

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else torch.autocast("cpu", enabled=False)

    def logits_of(model, x):
        with autocast():
            return model(input_ids=x, use_cache=False).logits.float().reshape(-1, V)

    def loss_fn(model, x, y):
        return F.cross_entropy(logits_of(model, x), y.reshape(-1))

    teacher = None
    if args.teacher:
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(
            args.teacher, dtype=torch.bfloat16 if use_amp else torch.float32, attn_implementation=args.attn
        ).to(dev)
        teacher.eval()
        for p_ in teacher.parameters():
            p_.requires_grad_(False)
        assert teacher.config.vocab_size == V
        log(f"[{args.which}] distilling from {args.teacher}: loss = {args.kd_alpha} * CE + {1 - args.kd_alpha} * KL(teacher || student)")

    def train_loss(model, x, y):
        """(loss to minimize, hard-label CE for the log)"""
        s_logits = logits_of(model, x)
        ce = F.cross_entropy(s_logits, y.reshape(-1))
        if teacher is None:
            return ce, ce
        with torch.no_grad():
            t_logp = F.log_softmax(logits_of(teacher, x), dim=-1)
        kl = F.kl_div(F.log_softmax(s_logits, dim=-1), t_logp, log_target=True, reduction="batchmean")
        return args.kd_alpha * ce + (1.0 - args.kd_alpha) * kl, ce

    @torch.no_grad()
    def evaluate(model, bs=64, with_agree=False):
        """Held-out CE; with a teacher also the top-1 agreement student vs teacher."""
        model.eval()
        tot, n, agree = 0.0, 0, 0
        for i in range(0, n_win, bs):
            x, y = ev_x[i : i + bs], ev_y[i : i + bs]
            lg = logits_of(model, x)
            tot += float(F.cross_entropy(lg, y.reshape(-1))) * y.numel()
            n += y.numel()
            if teacher is not None and with_agree:
                agree += int((lg.argmax(-1) == logits_of(teacher, x).argmax(-1)).sum())
        model.train()
        return (tot / n, agree / n) if with_agree else tot / n

    def fresh(experts):
        torch.manual_seed(args.seed)
        m = build_model(cfg, args.attn, experts).to(dev)
        m.train()
        return m

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        ar = torch.arange(ctx + 1, device=dev)
        hi = train_t.numel() - ctx - 1
        while True:
            off = torch.randint(0, hi, (batch,), generator=g).to(dev)
            w = train_t[off[:, None] + ar]
            yield w[:, :-1], w[:, 1:]

    # Experts implementation: grouped_mm when it runs and matches eager, else eager.
    want = None if args.experts == "auto" else args.experts
    model = fresh(want)
    impl = experts_impl(model)
    if args.experts == "auto" and impl != "eager":
        try:
            x, y = next(batches(args.seed + 1))
            l1 = loss_fn(model, x[:4], y[:4])
            l1.backward()
            model.zero_grad(set_to_none=True)
            ref = fresh("eager")
            l0 = loss_fn(ref, x[:4], y[:4])
            del ref
            if not abs(float(l1.detach()) - float(l0.detach())) < 2e-2:
                raise RuntimeError(f"{impl} loss {float(l1.detach()):.5f} != eager {float(l0.detach()):.5f}")
            log(f"[{args.which}] experts '{impl}' matches eager on a probe batch ({float(l1.detach()):.5f} vs {float(l0.detach()):.5f})")
        except Exception as e:  # noqa: BLE001
            log(f"[{args.which}] experts '{impl}' unusable ({type(e).__name__}: {e}); using eager")
            impl = "eager"
            model = fresh("eager")
    total, active = count_params(model)
    log(f"[{args.which}] params total {total:,} active/token {active:,} experts_impl {impl} attn {args.attn}")

    steps = args.steps
    probe = None
    if steps is None:
        opt = make_optimizer(model, peak_lr, args.weight_decay)
        it = batches(args.seed + 2)
        for i in range(40):
            if i == 10:
                float(loss)
                t0 = time.perf_counter()
            x, y = next(it)
            loss, _ = train_loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        float(loss)
        step_s = (time.perf_counter() - t0) / 30
        evaluate(model)
        t1 = time.perf_counter()
        evaluate(model)
        eval_s = time.perf_counter() - t1
        budget = args.time_budget * 0.92
        steps = int((budget - eval_s) / (step_s + eval_s / args.eval_every))
        steps = max(steps, 2 * args.warmup)
        probe = {"step_s": step_s, "eval_s": eval_s, "time_budget_s": args.time_budget}
        log(f"[{args.which}] probe: {step_s * 1e3:.1f} ms/step, eval {eval_s:.2f} s -> {steps} steps")
        del opt, model
        model = fresh(impl)

    tokens_per_step = batch * ctx
    log(
        f"[{args.which}] steps {steps} batch {batch} ctx {ctx} tokens/step {tokens_per_step} "
        f"tokens total {steps * tokens_per_step:,} (~{steps * tokens_per_step / train_t.numel():.1f} epochs) "
        f"lr {peak_lr} warmup {args.warmup} seed {args.seed}"
    )
    opt = make_optimizer(model, peak_lr, args.weight_decay)
    balancer = RouterBalancer(model, args.bias_update)
    it = batches(args.seed)
    curve = []
    best = (float("inf"), -1, None)
    run_loss, run_n = 0.0, 0
    t_start = time.perf_counter()
    for step in range(steps):
        lr = lr_at(step, steps, peak_lr, min(args.warmup, steps // 2 or 1))
        for gp in opt.param_groups:
            gp["lr"] = lr
        x, y = next(it)
        loss, ce = train_loss(model, x, y)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balancer.step()
        run_loss += ce.detach()
        run_n += 1
        last = step == steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            tr = float(run_loss) / run_n
            run_loss, run_n = 0.0, 0
            ho = evaluate(model, with_agree=teacher is not None)
            if teacher is not None:
                ho, agree = ho
            el = time.perf_counter() - t_start
            rec = {
                "step": step + 1,
                "tokens": (step + 1) * tokens_per_step,
                "train_loss": round(tr, 4),
                "heldout_loss": round(ho, 4),
                "lr": lr,
                "grad_norm": round(float(gnorm), 3),
                "expert_load_max_over_mean": round(balancer.last_imbalance, 3),
                "elapsed_s": round(el, 1),
            }
            if teacher is not None:
                rec["heldout_top1_agreement_with_teacher"] = round(agree, 4)
            curve.append(rec)
            log(
                f"[{args.which}] step {step + 1:5d}/{steps} train {tr:.4f} heldout {ho:.4f} lr {lr:.2e} "
                f"gnorm {float(gnorm):.2f} load max/mean {balancer.last_imbalance:.2f} "
                f"{el:6.1f}s {(step + 1) * tokens_per_step / el:,.0f} tok/s"
                + (f" top1-agree {agree:.4f}" if teacher is not None else "")
            )
            if ho < best[0]:
                best = (ho, step + 1, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    train_s = time.perf_counter() - t_start
    final_heldout = curve[-1]["heldout_loss"]
    log(f"[{args.which}] done in {train_s:.1f} s; best heldout {best[0]:.4f} at step {best[1]}")
    model.load_state_dict(best[2])

    # Save in bf16 and check the rounded weights.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # bf16 everywhere except the router (gate.weight, e_score_correction_bias), which stays fp32 as
    # in DeepSeek-V3's checkpoints (HF keeps those two in fp32 on load: _keep_in_fp32_modules_strict).
    model = model.to(torch.bfloat16)
    for name, mod in model.named_modules():
        if mod in balancer.routers:
            mod.weight.data = best[2][f"{name}.weight"].to(dev, torch.float32)
            mod.e_score_correction_bias.data = best[2][f"{name}.e_score_correction_bias"].to(dev, torch.float32)
    model.config.dtype = torch.bfloat16
    agree_bf16 = None
    if teacher is not None:
        heldout_bf16, agree_bf16 = evaluate(model, with_agree=True)
    else:
        heldout_bf16 = evaluate(model)
    log(f"[{args.which}] heldout loss with bf16 weights: {heldout_bf16:.4f}"
        + (f", top-1 agreement with teacher {agree_bf16:.4f}" if agree_bf16 is not None else ""))
    model.config.use_cache = True
    if hasattr(model, "generation_config") and model.generation_config is not None:
        gc = model.generation_config
        gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = 1, 2, 0
    model.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        if (data_dir / f).exists():
            shutil.copy(data_dir / f, out / f)
    facts = {
        "which": args.which,
        "params_total": total,
        "params_active_per_token": active,
        "steps": steps,
        "batch": batch,
        "ctx": ctx,
        "tokens_seen": steps * tokens_per_step,
        "epochs": steps * tokens_per_step / train_t.numel(),
        "peak_lr": peak_lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "bias_update": args.bias_update,
        "teacher": args.teacher,
        "kd_alpha": args.kd_alpha if args.teacher else None,
        "seed": args.seed,
        "experts_impl": impl,
        "attn": args.attn,
        "train_seconds": round(train_s, 1),
        "probe": probe,
        "best_step": best[1],
        "best_heldout_loss": round(best[0], 4),
        "final_heldout_loss": final_heldout,
        "heldout_loss_bf16_weights": round(heldout_bf16, 4),
        "heldout_top1_agreement_with_teacher": agree_bf16,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "curve": curve,
        "argv": sys.argv[1:],
    }
    (out / "train_log.json").write_text(json.dumps(facts, indent=1) + "\n")
    log(f"[{args.which}] saved to {out}: {sorted(os.listdir(out))}")


if __name__ == "__main__":
    main()
