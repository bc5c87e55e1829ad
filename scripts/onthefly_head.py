"""Grow a draft head in one timed job: the target writes prompts, answers them, and the head
trains on the answers with features computed per batch (``evospec/train/onthefly.py``).

Made for a lent GPU (one call of a few minutes, no network, no ``../shared``), and runs the
same on a CPU, only slower. Two steps:

1. ``prepare`` (here, where the data and the tokenizer are): the training-side prompts of
   ``--data`` rendered as chat prompt ids, the datasets' answered conversations as (prompt,
   answer) ids, and the chat template's pieces for self-written prompts, in one ``.npz``:

       .venv/bin/python scripts/onthefly_head.py prepare --data ../shared/data --out /tmp/mix.npz

2. ``run`` (on the machine that trains): load the target (a GGUF file or a registered name),
   sample ``--self-seconds`` of user prompts (Magpie-style: the chat template up to the user's
   turn, half of them started with one of ``self_prompts.OPENERS``), answer them and the
   prepared prompts greedily for ``--gen-seconds`` (continuous batching, grouped prefill on a
   GPU), save the answers' token ids, then train the head (``--init``, default the shipped one)
   for ``--train-seconds`` on them plus ``--teacher-share`` of dataset answers:

       python3 scripts/onthefly_head.py run --model model.gguf --mix /tmp/mix.npz --out OUT \\
           --self-seconds 60 --gen-seconds 240 --train-seconds 200 --device cuda

   It writes ``OUT/head`` (EAGLE-2 layout, fp16, with ``training.json``) and
   ``OUT/answers_NN.npz`` (the generated token ids: ``run --answers`` trains on them again
   without generating).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- ragged id lists <-> flat arrays ---------------------------------------------------------------
def pack(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    flat = np.fromiter((t for ids in lists for t in ids), dtype=np.int32)
    offsets = np.cumsum([0, *(len(ids) for ids in lists)]).astype(np.int64)
    return flat, offsets


def unpack(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    flat = flat.astype(np.int64)
    return [flat[a:b].tolist() for a, b in itertools.pairwise(offsets)]


# -- prepare ---------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> None:
    from evospec.models.loading import load_model
    from evospec.train.conversations import training_conversations
    from evospec.train.prompts import training_prompts

    sys.path.insert(0, str(Path(__file__).parent))
    from self_prompts import MARK, OPENERS

    codec = load_model(args.model, progress=False, pack=False, step_graph=False, fused_ops=False).codec
    prompts = [codec.encode_chat([{"role": "user", "content": p.text}]) for p in training_prompts(args.data)]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    eos = [*codec.eos_ids][:1]
    convs = []
    for c in training_conversations(args.data):
        prompt, answer = codec.encode_chat(list(c.history)), [*codec.encode_text(c.answer), *eos]
        if len(answer) >= 2 and len(prompt) <= args.max_prompt_tokens:
            convs.append((prompt, answer[: args.max_new_tokens]))
    rendered = codec.render_chat([{"role": "user", "content": MARK}])
    at = rendered.index(MARK)
    prefix = codec.tok.encode(rendered[:at], add_special_tokens=False).ids
    suffix = codec.tok.encode(rendered[at + len(MARK) :], add_special_tokens=False).ids
    openers = [codec.tok.encode(o, add_special_tokens=False).ids for o in OPENERS]
    arrays = {}
    for name, lists in (
        ("prompts", prompts),
        ("conv_prompts", [p for p, _ in convs]),
        ("conv_answers", [a for _, a in convs]),
        ("openers", openers),
    ):
        arrays[name], arrays[name + "_off"] = pack(lists)
    np.savez_compressed(
        args.out,
        **arrays,
        prefix=np.array(prefix, dtype=np.int32),
        suffix=np.array(suffix, dtype=np.int32),
        eos=np.array([*codec.eos_ids], dtype=np.int32),
    )
    print(
        f"{args.out}: {len(prompts)} prompts, {len(convs)} answered conversations "
        f"({sum(len(a) for _, a in convs)} answer tokens), {Path(args.out).stat().st_size / 1e6:.1f} MB"
    )


# -- run -------------------------------------------------------------------------------------------
def self_prompts(model, mix, seconds: float, batch: int, seed: int) -> list[list[int]]:
    """Chat prompt ids of user messages the target samples itself (T 1.0, top-p 0.95), deduplicated."""
    from evospec.decoding.sampling import SamplingParams, target_probs
    from evospec.train.batch_generate import greedy_stream

    prefix, suffix = mix["prefix"].tolist(), mix["suffix"].tolist()
    openers = [[], *unpack(mix["openers"], mix["openers_off"])]  # [] = no opener, the model's own
    eos = set(mix["eos"].tolist())
    params = SamplingParams(max_new_tokens=97, temperature=1.0, top_p=0.95)
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(target_probs(logits, params), 1, generator=gen)[:, 0]

    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    attempt, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        starts = []
        for i in range(4 * batch):  # half free, half started with the openers in turn
            o = (
                openers[0]
                if (attempt + i) % 2 == 0
                else openers[1 + ((attempt + i) // 2) % (len(openers) - 1)]
            )
            starts.append(o)
        attempt += len(starts)
        stream = greedy_stream(
            model,
            [prefix + o for o in starts],
            97,
            list(eos),
            batch_size=batch,
            cache_len=len(prefix) + 16 + 2 * 97,
            pick=pick,
        )
        for done in stream:
            if not done.answer or done.answer[-1] not in eos or len(done.answer) < 6:
                continue  # unfinished or too short to be a request
            user = tuple(starts[done.index] + done.answer[:-1])
            if user not in seen:
                seen.add(user)
                out.append(prefix + list(user) + suffix)
            if time.perf_counter() >= end:
                break
        log(f"self prompts: {len(out)} after {attempt} attempts")
    return out


def generate(model, prompts: list[list[int]], eos: list[int], args) -> list[tuple[list[int], list[int]]]:
    from evospec.train.batch_generate import greedy_stream

    answers: list[tuple[list[int], list[int]]] = []
    end, tokens, last = time.perf_counter() + args.gen_seconds, 0, time.perf_counter()
    stream = greedy_stream(
        model,
        prompts,
        args.max_new_tokens,
        eos,
        batch_size=args.batch_size,
        cache_len=args.cache_len,
    )
    for done in stream:
        answers.append((prompts[done.index], done.answer))
        tokens += len(done.answer)
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            rate = tokens / (last - end + args.gen_seconds)
            log(f"generated {len(answers)} answers, {tokens} tokens ({rate:.0f} tok/s)")
        if time.perf_counter() >= end:
            break
    return answers


def save_answers(answers, out: Path, per_file: int) -> list[Path]:
    files = []
    for i in range(0, len(answers), per_file):
        part = answers[i : i + per_file]
        p, po = pack([a for a, _ in part])
        r, ro = pack([b for _, b in part])
        f = out / f"answers_{i // per_file:02d}.npz"
        np.savez_compressed(
            f,
            prompts=p.astype(np.uint16 if p.max(initial=0) < 65536 else np.int32),
            prompts_off=po,
            answers=r.astype(np.uint16 if r.max(initial=0) < 65536 else np.int32),
            answers_off=ro,
        )
        files.append(f)
    return files


def load_answers(files: list[Path]) -> list[tuple[list[int], list[int]]]:
    out = []
    for f in files:
        d = np.load(f)
        out += list(
            zip(unpack(d["prompts"], d["prompts_off"]), unpack(d["answers"], d["answers_off"]), strict=True)
        )
    return out


def answer_prompts(model, mix, rng: random.Random, args, info: dict) -> list[tuple[list[int], list[int]]]:
    """Self-written prompts, then greedy answers to them and the mix for ``--gen-seconds``
    (saved under ``--out``); the rates go into ``info["generation"]``."""
    own = self_prompts(model, mix, args.self_seconds, args.batch_size, args.seed) if args.self_seconds else []
    # the mix in its own order (its sources interleaved), self-written prompts drawn in with
    # probability --self-share at each place until either runs out: any prefix holds both
    mixed = [p for p in unpack(mix["prompts"], mix["prompts_off"]) if len(p) <= args.max_prompt_tokens]
    prompts, i, j = [], 0, 0
    while i < len(own) and j < len(mixed):
        if rng.random() < args.self_share:
            prompts.append(own[i])
            i += 1
        else:
            prompts.append(mixed[j])
            j += 1
    prompts += own[i:] + mixed[j:]
    log(f"{len(own)} self-written + {len(mixed)} mix prompts")
    t = time.perf_counter()
    answers = generate(model, prompts, mix["eos"].tolist(), args)
    gen_s = time.perf_counter() - t
    n_tok = sum(len(a) for _, a in answers)
    info["generation"] = {
        "self_prompts": len(own),
        "answers": len(answers),
        "answer_tokens": n_tok,
        "seconds": round(gen_s, 1),
        "tokens_per_second": round(n_tok / gen_s, 1),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
    }
    log(f"generation: {info['generation']}")
    files = save_answers(answers, args.out, args.answers_per_file)
    log(f"saved {[f.name for f in files]}")
    return answers


def run(args: argparse.Namespace) -> None:
    from evospec.models.eagle import load_eagle, new_eagle_for, save_eagle, widen_mlp
    from evospec.models.loading import load_model, resolve_device
    from evospec.models.registry import default_head
    from evospec.train.onthefly import Budget, token_seq, train_head_onthefly
    from evospec.train.trainer import TrainConfig

    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 products (~1e-3 relative)
    torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, device=device, progress=False, weights="fp32")
    model = loaded.model
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.machine()
    log(f"target {loaded.name} on {device} ({where})")
    init = {"shipped": default_head(loaded.name), "none": None}.get(args.init, args.init)
    if args.init == "shipped" and init is None:  # before minutes of generation, not after
        raise SystemExit(f"--init shipped: no head ships for {loaded.name} (give a folder, or none)")
    if init is not None and not Path(init).is_dir():
        raise SystemExit(f"--init {init}: no such head folder")
    mix = np.load(args.mix)
    rng = random.Random(args.seed)
    info: dict = {"command": "scripts/onthefly_head.py " + " ".join(sys.argv[1:])}
    if args.answers:
        answers = load_answers(args.answers)
        log(f"{len(answers)} answers read")
    else:
        answers = answer_prompts(model, mix, rng, args, info)
    seqs = [token_seq(p, a, args.max_len) for p, a in answers if len(a) >= 2]
    conv = list(
        zip(
            unpack(mix["conv_prompts"], mix["conv_prompts_off"]),
            unpack(mix["conv_answers"], mix["conv_answers_off"]),
            strict=True,
        )
    )
    rng.shuffle(conv)
    want = int(
        args.teacher_share * sum(len(s.tokens) - s.prompt_len for s in seqs) / (1 - args.teacher_share)
    )
    taught, have = [], 0
    for p, a in conv:
        if have >= want:
            break
        taught.append(token_seq(p, a, args.max_len, greedy=False))
        have += len(a)
    seqs += taught
    log(f"training on {len(seqs)} sequences ({have} teacher-forced answer tokens)")
    head = load_eagle(init, device=device).attach(model) if init else new_eagle_for(model)
    if args.widen_mlp:  # grown silent: it drafts as --init does until training uses the new units
        head = widen_mlp(head, args.widen_mlp)
    head = head.to(device)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(
        lr=args.lr,
        tokens_per_batch=args.tokens_per_batch,
        steps=args.steps,
        warmup_steps=args.warmup,
        holdout=args.holdout,
    )
    budget = Budget(epochs=args.epochs, seconds=args.train_seconds)

    def checkpoint(train_log: dict) -> None:  # each epoch: a head survives a later failure
        save_eagle(head, args.out / "head")
        write_info(args.out / "head", info | {"train_log": train_log})

    train_log = train_head_onthefly(
        head, model, seqs, cfg, budget, progress=args.progress, on_epoch=checkpoint
    )
    save_eagle(head, args.out / "head")
    info |= {
        "target": loaded.name,
        "teacher_weights": "fp32 (TF32 products)" if device.startswith("cuda") else "fp32",
        "init": str(init),
        "teacher_forced_sequences": len(taught),
        "teacher_forced_tokens": have,
        "hardware": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.machine(),
        "torch": torch.__version__,
        "train_log": train_log,
        "wall_seconds": round(time.perf_counter() - T0, 1),
    }
    write_info(args.out / "head", info)
    log(f"saved {args.out / 'head'}")


def write_info(folder: Path, info: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "training.json").write_text(json.dumps(info, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize the training-side prompts and answers into one .npz")
    p.add_argument("--data", type=Path, nargs="+", default=[Path("../shared/data")])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    r = sub.add_parser("run", help="self prompts, answers, on-the-fly training, in one timed job")
    r.add_argument("--model", default="smollm2-135m-instruct", help="registered name or .gguf file")
    r.add_argument("--mix", type=Path, required=True, help="the prepare step's .npz")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument(
        "--init", default="shipped", help="head to continue: 'shipped', a folder, or 'none' (a new head)"
    )
    r.add_argument(
        "--answers",
        type=Path,
        nargs="*",
        default=None,
        help="train on these answers_NN.npz instead of generating",
    )
    r.add_argument(
        "--widen-mlp", type=int, default=None, metavar="N", help="grow --init's MLP to N units first"
    )
    r.add_argument("--device", default="auto")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--self-seconds", type=float, default=60.0)
    r.add_argument("--self-share", type=float, default=0.6, help="share of self-written prompts answered")
    r.add_argument("--gen-seconds", type=float, default=240.0)
    r.add_argument("--train-seconds", type=float, default=200.0)
    r.add_argument("--epochs", type=int, default=4, help="at most this many epochs within --train-seconds")
    r.add_argument("--batch-size", type=int, default=512, help="generation rows")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=384)
    r.add_argument("--cache-len", type=int, default=1280)
    r.add_argument("--max-len", type=int, default=576, help="longest training sequence (tail kept)")
    r.add_argument(
        "--teacher-share", type=float, default=0.1, help="share of dataset answers in the training tokens"
    )
    r.add_argument("--tokens-per-batch", type=int, default=16384)
    r.add_argument("--lr", type=float, default=4e-4)
    r.add_argument("--warmup", type=int, default=50)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--holdout", type=float, default=0.02)
    r.add_argument("--answers-per-file", type=int, default=25_000)
    r.add_argument("--progress", action="store_true", help="progress bars (off: log lines only)")
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    main()
