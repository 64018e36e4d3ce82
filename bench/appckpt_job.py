#!/usr/bin/env python3
"""The training job of bench/appckpt_gpu.py: application-level checkpoints (torch.save, PyTorch Distributed
Checkpoint) and the hooks the harness needs around gputrace's, on one GPT-2 style model.

    appckpt_job.py --size small|large [--control DIR]
    appckpt_job.py --size small|large --resume-from torch|dcp PATH [--t0 MONOTONIC] [--dcp-api ...] [--dcp-pg ...]

The model: transformers' GPT2LMHeadModel built from GPT2Config (random init, nothing downloaded; dropout off
and eager attention, so that a step is a deterministic function of the state: with
torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG=:4096:8, set by the harness, the same state
gives bitwise the same losses, in this process or a fresh one), AdamW(capturable=True: its step counts live
on the device with everything else, so a rollback of device memory alone restores the whole training state),
one fixed batch of random token ids for training and another for evaluation.
  small  6 layers, n_embd 512, 8 heads, vocabulary 8192, 256 positions, batch 8 x 128  (about 23M parameters)
  large  24 layers, n_embd 1024, 16 heads, vocabulary 50257, 1024 positions, batch 4 x 512 (about 355M
         parameters: GPT-2 medium; model + AdamW state about 4 GiB in fp32)

Driven mode: one command a line, on stdin, or with --control DIR from files DIR/cmd-000001, DIR/cmd-000002,
... (each written whole by the harness; nothing stays open, so CRIU can checkpoint the job while it waits,
and the files may change before it is restored).  A line may start with a token "@TOKEN", which the answer
carries as "tok".  One JSON line per answer on stdout ("ok": false and "error" when a command fails; the
job goes on).  After set-up and warm-up (a few steps and one evaluation, so that the caching allocator
holds every block a step needs) it prints {"ready": true, ...}.  Commands:
  train K [stamps]            K steps; seconds, steps_per_s, the losses (float.hex), each step's duration
                              ("stamps": also each step's end, CLOCK_MONOTONIC seconds)
  train-for SECONDS [stamps]  steps until SECONDS have passed (the paired phases' rate)
  train-until FLAG MAX_S [stamps]  steps until the file FLAG exists (or MAX_S passed): training while
                              something outside checkpoints the job; first prints {"tok": TOKEN-started}
  heartbeat-until FLAG MAX_S  a one-element kernel and a synchronize about every millisecond, the model
                              untouched, until FLAG exists: the longest gap is how long the job's GPU work
                              was held by a checkpoint taken meanwhile; first prints {"tok": TOKEN-started}
  loss                        the evaluation loss on the fixed evaluation batch (float.hex), no state change
  save-torch PATH             torch.save({model, optimizer, step} state_dicts), flushed and fsynced:
                              held_s (the training loop blocked), bytes
  load-torch PATH             torch.load + load_state_dict into the live model and optimizer: seconds
  save-dcp PATH               torch.distributed.checkpoint.save, synchronous: held_s, bytes
  load-dcp PATH               torch.distributed.checkpoint.load + set_state_dict into the live job
  save-dcp-async PATH [BEFORE_S [MAX_S]] [pinned]  (defaults 2 and 300 s)
                              BEFORE_S of steps (the rate before), then dcp.async_save: held_s until it
                              returns (the state staged into host memory; with "pinned": a DefaultStager
                              with pinned memory and staging in the background, held until staging is
                              done); then steps until the write completes: write_s (from the call), the
                              steps that ran meanwhile and their rate; the evaluation loss of the saved
                              state and the losses of the two steps after it (to check a resume against)
  info                        parameters, state bytes, GPU memory
  quit
The process group DCP uses: gloo, world size 1, on a free localhost port, made at the first DCP command
(--dcp-pg none: none; DCP then saves as a single process).  The state dicts DCP sees come from
torch.distributed.checkpoint.state_dict.get_state_dict (fully qualified names for the optimizer's state),
or, where that fails, from model.state_dict() and optimizer.state_dict(); the answer names which ("api").

Resume mode (--resume-from): what a job restarted after a failure pays: the process starts, imports, builds
the model and optimizer, loads the checkpoint, and trains.  One JSON line with "resumed": true: since_spawn_s
at each phase (from --t0, the harness's CLOCK_MONOTONIC at the spawn; else from this script's first line),
import_s, build_s, load_s, the evaluation loss right after loading (eval_s, not counted in resume_s), the
first step's time and loss and the second's (which depends on the optimizer's state too), and resume_s:
spawn to the end of the first step, less the evaluation.
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # before any import: the resume mode's clock starts here without --t0

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch creates a cuBLAS handle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SIZES = {
    "small": dict(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=256, batch=8, seq=128),
    "large": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024, batch=4, seq=512),
}


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def tree_bytes(path: str) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                total += os.lstat(full).st_size
    return total


def remove(path: str) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """The model, its optimizer, the fixed batches, and every operation the commands need."""

    def __init__(self, size: str, attn: str, dcp_pg: str) -> None:
        t0 = time.monotonic()
        import torch
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        self.torch = torch
        self.import_s = time.monotonic() - t0
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        if not torch.cuda.is_available():
            raise SystemExit("appckpt_job: no CUDA device")
        t1 = time.monotonic()
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, as training jobs run them
        self.dev = dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        s = SIZES[size]
        self.size, self.spec = size, s
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"], vocab_size=s["vocab_size"],
                         n_positions=s["n_positions"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         use_cache=False, attn_implementation=attn)
        self.model = GPT2LMHeadModel(cfg).to(dev)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, capturable=True)
        g = torch.Generator(device=dev).manual_seed(1)
        self.ids = torch.randint(0, s["vocab_size"], (s["batch"], s["seq"]), device=dev, generator=g)
        self.eval_ids = torch.randint(0, s["vocab_size"], (s["batch"], s["seq"]), device=dev, generator=g)
        self.hb = torch.zeros(1, device=dev)  # the heartbeat's own tensor
        torch.cuda.synchronize()
        self.build_s = time.monotonic() - t1
        self.step = 0
        self.dcp_pg = dcp_pg
        self.pg: str | None = None  # "gloo" once made; "none: why" when DCP runs without one
        self.dcp_api: str | None = None

    # --- training -------------------------------------------------------------------------------------------

    def one_step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.step += 1
        return loss.item()  # a synchronize: the step's time is the GPU's too

    def train(self, k: int | None = None, seconds: float | None = None, flag: str | None = None,
              max_s: float | None = None, stamps: bool = False, min_steps: int = 1) -> dict:
        losses, durs, ends = [], [], []
        t0 = prev = time.monotonic()
        while True:
            losses.append(self.one_step())
            now = time.monotonic()
            durs.append(now - prev)
            ends.append(now)
            prev = now
            n = len(losses)
            if k is not None and n >= k:
                break
            if n >= min_steps:
                if seconds is not None and now - t0 >= seconds:
                    break
                if flag is not None and os.path.exists(flag):
                    break
                if max_s is not None and now - t0 >= max_s:
                    break
        el = prev - t0
        out = {"steps": len(losses), "seconds": el, "steps_per_s": len(losses) / el if el > 0 else None,
               "step": self.step, "loss": losses[-1].hex(), "losses": [x.hex() for x in losses[:16]],
               "step_s": [round(d, 6) for d in durs], "step_s_median": statistics.median(durs),
               "first_step_s": durs[0], "t0": t0}
        if stamps:
            out["stamps"] = [round(x, 6) for x in ends]
        return out

    def eval_loss(self) -> tuple[str, float]:
        t0 = time.monotonic()
        with self.torch.no_grad():
            loss = self.model(input_ids=self.eval_ids, labels=self.eval_ids).loss.item()
        return loss.hex(), time.monotonic() - t0

    def heartbeat(self, flag: str, max_s: float) -> dict:
        torch = self.torch
        t0 = prev = time.monotonic()
        gaps: list[tuple[float, float]] = []  # (gap, when it began)
        while not os.path.exists(flag) and prev - t0 < max_s:
            self.hb.add_(1.0)
            torch.cuda.synchronize()
            now = time.monotonic()
            gaps.append((now - prev, prev))
            prev = now
            time.sleep(0.0005)
        if not gaps:
            return {"beats": 0, "seconds": prev - t0}
        longest = max(gaps)
        typical = statistics.median(g for g, _ in gaps)
        return {"beats": len(gaps), "seconds": prev - t0, "max_gap_s": longest[0], "max_gap_at": longest[1],
                "median_gap_s": typical, "held_s": max(0.0, longest[0] - typical),
                "gaps_over_10ms": sorted(([round(g, 6), round(at, 6)] for g, at in gaps if g > 0.01),
                                         reverse=True)[:8],
                "flag_seen": os.path.exists(flag)}

    # --- sizes ----------------------------------------------------------------------------------------------

    def info(self) -> dict:
        torch = self.torch
        seen: set[int] = set()
        model_bytes = optim_bytes = 0
        for t in self.model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                model_bytes += t.numel() * t.element_size()
        for st in self.opt.state.values():
            for t in st.values():
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    optim_bytes += t.numel() * t.element_size()
        return {"params": sum(p.numel() for p in self.model.parameters()), "model_bytes": model_bytes,
                "optim_bytes": optim_bytes, "state_bytes": model_bytes + optim_bytes,
                "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "device": torch.cuda.get_device_name(0), "step": self.step, "spec": self.spec, **self.versions}

    # --- torch.save / torch.load ----------------------------------------------------------------------------

    def save_torch(self, path: str) -> dict:
        remove(path)
        t0 = time.monotonic()
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step}
        with open(path, "wb") as f:
            self.torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        held = time.monotonic() - t0
        return {"held_s": held, "bytes": os.path.getsize(path), "step": self.step}

    def load_torch(self, path: str) -> dict:
        t0 = time.monotonic()
        sd = self.torch.load(path, map_location=self.dev, weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.step = int(sd["step"])
        del sd
        self.torch.cuda.synchronize()
        return {"seconds": time.monotonic() - t0, "step": self.step}

    # --- DCP ------------------------------------------------------------------------------------------------

    def ensure_pg(self) -> None:
        if self.pg is not None:
            return
        if self.dcp_pg == "none":
            self.pg = "none: --dcp-pg none"
            return
        import torch.distributed as dist

        if dist.is_initialized():
            self.pg = "existing"
            return
        try:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
            self.pg = "gloo"
        except Exception as exc:  # DCP then saves as a single process (no_dist)
            self.pg = f"none: init_process_group('gloo') failed: {type(exc).__name__}: {exc}"[:400]

    def init_optim_state(self) -> None:
        """The optimizer's state made (zero gradients, a step at lr 0) when it has none, as
        torch.distributed.checkpoint.state_dict does, so that a load has tensors to fill."""
        if self.opt.state:
            return
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = self.torch.zeros_like(p)
        lrs = [g["lr"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["lr"] = 0.0
        self.opt.step()
        for g, lr in zip(self.opt.param_groups, lrs):
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)

    def dcp_state(self, api: str | None = None) -> tuple[dict, str]:
        """{"model", "optim", "step"} for DCP, through get_state_dict where it works (or where `api` says)."""
        torch = self.torch
        if api in (None, "state_dict"):
            try:
                from torch.distributed.checkpoint.state_dict import get_state_dict

                msd, osd = get_state_dict(self.model, self.opt)
                return {"model": msd, "optim": osd, "step": torch.tensor(self.step)}, "state_dict"
            except Exception as exc:
                if api == "state_dict":
                    raise
                self.dcp_api_error = f"get_state_dict failed: {type(exc).__name__}: {exc}"[:400]
        self.init_optim_state()
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "step": torch.tensor(self.step)}, "plain"

    def save_dcp(self, path: str) -> dict:
        import torch.distributed.checkpoint as dcp

        remove(path)
        self.ensure_pg()
        t0 = time.monotonic()
        sd, api = self.dcp_state(self.dcp_api)
        dcp.save(sd, checkpoint_id=path)
        held = time.monotonic() - t0
        self.dcp_api = api
        return {"held_s": held, "bytes": tree_bytes(path), "step": self.step, "api": api, "pg": self.pg,
                **({"api_error": self.dcp_api_error} if getattr(self, "dcp_api_error", None) else {})}

    def load_dcp(self, path: str, api: str | None = None) -> dict:
        import torch.distributed.checkpoint as dcp

        self.ensure_pg()
        api = api or self.dcp_api
        t0 = time.monotonic()
        sd, api = self.dcp_state(api)
        dcp.load(sd, checkpoint_id=path)
        if api == "state_dict":
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            self.model.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])
        self.step = int(sd["step"])
        del sd
        self.torch.cuda.synchronize()
        return {"seconds": time.monotonic() - t0, "step": self.step, "api": api, "pg": self.pg}

    def save_dcp_async(self, path: str, before_s: float, max_s: float, pinned: bool) -> dict:
        import torch.distributed.checkpoint as dcp

        remove(path)
        self.ensure_pg()
        before = self.train(seconds=before_s)
        eval_hex, _ = self.eval_loss()
        saved_step = self.step
        stager = None
        done_at: list[float] = []
        t0 = time.monotonic()
        sd, api = self.dcp_state(self.dcp_api)
        if pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=True))
            r = dcp.async_save(sd, checkpoint_id=path, async_stager=stager)
        else:
            r = dcp.async_save(sd, checkpoint_id=path)
        t_return = time.monotonic()
        if hasattr(r, "upload_completion"):  # AsyncSaveResponse: staging may still run in the background
            r.staging_completion.result()  # the optimizer must not step before the state is staged
            upload = r.upload_completion
        else:
            upload = r
        t_staged = time.monotonic()
        upload.add_done_callback(lambda _f: done_at.append(time.monotonic()))
        self.dcp_api = api
        losses, ends = [], []
        while (not upload.done() or len(losses) < 2) and time.monotonic() - t0 < max_s:
            losses.append(self.one_step())
            ends.append(time.monotonic())
        try:
            upload.result(timeout=max(1.0, max_s - (time.monotonic() - t0)))
        finally:
            if stager is not None:
                stager.close()
        end = done_at[0] if done_at else time.monotonic()
        during = [t for t in ends if t <= end]
        span = end - t_staged
        return {"held_s": t_staged - t0, "returned_s": t_return - t0, "write_s": end - t0, "step": saved_step,
                "steps_during": len(during), "during_s": span,
                "steps_per_s_during": len(during) / span if span > 0 and during else None,
                "steps_per_s_before": before["steps_per_s"], "before_steps": before["steps"],
                "eval_at_save": eval_hex, "next_losses": [x.hex() for x in losses[:2]],
                "bytes": tree_bytes(path), "api": api, "pg": self.pg, "pinned": pinned,
                "note": "write_s: from the call until the future completed (its done callback); steps_during: "
                        "steps that ended before then"}


def command_lines(control: str | None, idle_exit_s: float):
    """The commands: stdin's lines, or DIR/cmd-NNNNNN in turn (polled; none open between reads)."""
    if control is None:
        yield from sys.stdin
        return
    n, last = 1, time.monotonic()
    while True:
        path = os.path.join(control, f"cmd-{n:06d}")
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            if time.monotonic() - last > idle_exit_s:
                emit(ok=False, error=f"no command for {idle_exit_s:.0f} s: the harness is gone; exiting")
                return
            time.sleep(0.005)
            continue
        n += 1
        last = time.monotonic()
        yield text


def driven(a) -> int:
    t0 = time.monotonic()
    tr = Trainer(a.size, a.attn, a.dcp_pg)
    for _ in range(a.warmup):
        tr.one_step()
    tr.eval_loss()  # its blocks in the caching allocator too, before anything is checkpointed
    tr.one_step()
    tr.torch.cuda.synchronize()
    emit(ready=True, tok="ready", pid=os.getpid(), startup_s=time.monotonic() - t0, import_s=tr.import_s,
         build_s=tr.build_s, warmup_steps=a.warmup + 1, size=a.size, attn=a.attn, **tr.info())
    for line in command_lines(a.control, a.idle_exit_s):
        words = line.split()
        if not words:
            continue
        tok = None
        if words[0].startswith("@"):
            tok, words = words[0][1:], words[1:]
        if not words:
            continue
        cmd, arg = words[0], words[1:]
        tag = {"tok": tok} if tok is not None else {}
        t = time.monotonic()
        try:
            if cmd == "train":
                r = tr.train(k=int(arg[0]), stamps="stamps" in arg[1:])
            elif cmd == "train-for":
                r = tr.train(seconds=float(arg[0]), stamps="stamps" in arg[1:])
            elif cmd == "train-until":
                emit(tok=f"{tok}-started", started=time.monotonic())
                r = tr.train(flag=arg[0], max_s=float(arg[1]), stamps="stamps" in arg[2:])
                r["flag_seen"] = os.path.exists(arg[0])
            elif cmd == "heartbeat-until":
                emit(tok=f"{tok}-started", started=time.monotonic())
                r = tr.heartbeat(arg[0], float(arg[1]))
            elif cmd == "loss":
                h, s = tr.eval_loss()
                r = {"loss": h, "seconds": s, "step": tr.step}
            elif cmd == "save-torch":
                r = tr.save_torch(arg[0])
            elif cmd == "load-torch":
                r = tr.load_torch(arg[0])
            elif cmd == "save-dcp":
                r = tr.save_dcp(arg[0])
            elif cmd == "load-dcp":
                r = tr.load_dcp(arg[0], arg[1] if len(arg) > 1 else None)
            elif cmd == "save-dcp-async":
                nums = [float(x) for x in arg[1:3] if x != "pinned"]
                r = tr.save_dcp_async(arg[0], nums[0] if nums else 2.0, nums[1] if len(nums) > 1 else 300.0,
                                      "pinned" in arg[1:])
            elif cmd == "info":
                r = tr.info()
            elif cmd == "quit":
                emit(ok=True, **tag)
                break
            else:
                raise ValueError(f"unknown command {cmd!r}")
            emit(ok=True, cmd=cmd, wall_s=time.monotonic() - t, end=time.monotonic(), **r, **tag)
        except Exception as exc:
            emit(ok=False, cmd=cmd, error=f"{type(exc).__name__}: {exc}"[:2000],
                 traceback=traceback.format_exc()[-3000:], **tag)
    close_process_group()
    return 0


def close_process_group() -> None:
    """The gloo group DCP was given, if one was made (quietly: the job is ending)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def resume(a) -> int:
    """A fresh process: start, build, load the checkpoint, train (see the module's docstring)."""
    t0 = a.t0 if a.t0 is not None else T_START
    since = {"script": T_START - t0}
    tr = Trainer(a.size, a.attn, a.dcp_pg)
    since["imported"] = since["script"] + tr.import_s
    since["built"] = time.monotonic() - t0
    tl = time.monotonic()
    if a.resume_from == "torch":
        ld = tr.load_torch(a.path)
    else:
        ld = tr.load_dcp(a.path, a.dcp_api)
    load_s = time.monotonic() - tl
    since["loaded"] = time.monotonic() - t0
    eval_hex, eval_s = tr.eval_loss()
    since["evaluated"] = time.monotonic() - t0
    first = tr.train(k=1)
    since["first_step"] = time.monotonic() - t0
    second = tr.train(k=1)
    emit(resumed=True, kind=a.resume_from, path=a.path, since_spawn_s=since, clock="t0" if a.t0 is not None else "script",
         import_s=tr.import_s, build_s=tr.build_s, load_s=load_s, load=ld, eval_loss=eval_hex, eval_s=eval_s,
         first_step_s=first["first_step_s"], losses=[first["loss"], second["loss"]], step=tr.step,
         resume_s=since["first_step"] - eval_s, **{k: v for k, v in tr.info().items() if k in ("params", "state_bytes")},
         **tr.versions)
    close_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--control", help="read commands from DIR/cmd-NNNNNN instead of stdin")
    ap.add_argument("--warmup", type=int, default=3, help="training steps before `ready` (default 3, then an "
                                                          "evaluation and one more step)")
    ap.add_argument("--attn", default="eager", help="the attention implementation (default eager: deterministic)")
    ap.add_argument("--dcp-pg", choices=("gloo", "none"), default="gloo",
                    help="the process group DCP runs under (default gloo, world size 1)")
    ap.add_argument("--idle-exit-s", type=float, default=1800,
                    help="with --control: exit when no command came for this long (default 1800)")
    ap.add_argument("--resume-from", choices=("torch", "dcp"), help="resume mode: the checkpoint's kind")
    ap.add_argument("path", nargs="?", help="resume mode: the checkpoint")
    ap.add_argument("--dcp-api", choices=("state_dict", "plain"), help="resume mode: how the DCP checkpoint's "
                                                                      "state dicts were made (its save's `api`)")
    ap.add_argument("--t0", type=float, help="resume mode: the spawn's CLOCK_MONOTONIC time (the harness's)")
    a = ap.parse_args()
    if a.resume_from:
        if not a.path:
            ap.error("--resume-from needs the checkpoint's PATH")
        return resume(a)
    return driven(a)


if __name__ == "__main__":
    sys.exit(main())
