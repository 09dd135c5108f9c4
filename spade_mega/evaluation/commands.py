"""``spade-mega eval CONFIG [KEY=VALUE ...] (--checkpoint DIR | --hf-weights DIR) [--suite NAME ...] [-o FILE]``:
score a run's Megatron checkpoint (streamed into the engine through the bridge, as training syncs it) or a Hugging
Face folder on the config's ``eval.suites``; print a table and write the results as JSON. The weights named are the
ones scored on every engine placement: servers it attaches to are loaded with them first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from spade_mega.config.loader import load_config
from spade_mega.errors import SpadeError


def format_table(results: Sequence[Any]) -> str:
    """One block per suite: its name and kind, then ``metric  value`` lines."""
    lines = []
    for result in results:
        lines.append(f"{result.name} ({result.kind})")
        width = max(len(name) for name in result.metrics)
        lines += [f"  {name:<{width}}  {value:.4g}" for name, value in result.metrics.items()]
    return "\n".join(lines)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomically: an interrupted write leaves the previous file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:
        raise SpadeError(f"{path}: cannot write the results ({exc.strerror or exc}); give -o a path you can write "
                         "to") from exc


def _eval(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from spade_mega.envs.sandbox import SandboxPool
    from spade_mega.evaluation.runner import Evaluator, selected
    from spade_mega.inference import build_engine
    from spade_mega.inference.server import attached_urls
    from spade_mega.tokenizer import check_folder_tokenizer, load_tokenizer

    cfg = load_config(args.config, list(args.overrides))
    if not cfg.eval.suites:
        raise SpadeError(f"{args.config}: no eval.suites to score; add suites under eval: (docs/evaluation.md)")
    suites = selected(cfg, args.suite)  # before minutes of loading weights
    # the folder scored (without --checkpoint): --hf-weights, else the config's inference.hf_weights
    folder = args.hf_weights or (cfg.inference.hf_weights if args.checkpoint is None else None)
    if args.checkpoint is None and folder is None:
        raise SpadeError("nothing to evaluate: give --checkpoint (a run's Megatron checkpoint) or --hf-weights "
                         "(a Hugging Face folder); without either the engine would score random weights")
    # servers someone else started serve whatever they last loaded (after a run: its trained weights): the folder
    # is loaded into them. Their engine keeps inference.hf_weights, the folder they were started on, to check it.
    attached = cfg.rollout.engine != "hf" and bool(attached_urls(cfg))
    if folder is not None and not (attached and cfg.inference.hf_weights):
        cfg.inference.hf_weights = folder  # the in-process engine loads it, a server started here starts on it
    if args.checkpoint is None and int(os.environ.get("RANK", "0")) != 0:
        return 0  # an HF folder needs no trainer: under torchrun rank 0 alone builds the engine and scores
    trainer = None
    if args.checkpoint is not None:  # every rank builds the trainer and loads its shards; rank 0 holds the engine
        from spade_mega.megatron import Trainer

        trainer = Trainer(cfg)
        try:
            step = trainer.load(args.checkpoint, weights_only=True)  # no Adam state: any optimizer kind or layout
        except BaseException:
            trainer.close()
            raise
        source: dict[str, Any] = {"checkpoint": str(Path(args.checkpoint).absolute()), "step": step}
    else:
        assert folder is not None
        check_folder_tokenizer(folder, cfg.model.tokenizer)
        source = {"hf_weights": str(Path(folder).absolute())}
    rank = dist.get_rank() if dist.is_initialized() else 0
    parts: list[Any] = []  # rank 0's engine and sandbox pool, closed at the end
    scratch: list[tuple[Path, tuple[int, Path]]] = []  # a server started here: its folder and lock, removed at the end

    def start() -> Evaluator:
        """Rank 0's engine, pool and evaluator (which reads the suites: a bad one fails before the weights move).
        The engine never releases its memory: nothing trains beside it (inference.release_memory is the run's). A
        server it starts writes its starting folder (randomly initialised weights, without inference.hf_weights)
        and its log into a temporary folder of this command's, never into the run directory: that is the run's
        (its own server restarts on its folder there, while it trains), maybe read-only, and two evaluations at
        once would rewrite one folder under each other's servers. The folder is locked while this process lives, as
        the engine's staging folders are: one that an eval killed without cleanup left (SIGKILL, or SIGTERM, on
        which Python runs none) is removed by the next eval."""
        from spade_mega.inference.server import _own_sync_root

        tokenizer = load_tokenizer(cfg.model.tokenizer)
        engine_cfg = cfg
        if cfg.rollout.engine != "hf" and not attached:
            scratch.append(_own_sync_root(Path(tempfile.gettempdir()), prefix="spade-eval-"))
            engine_cfg = replace(cfg, run=replace(cfg.run, output_dir=str(scratch[0][0])))
        engine = build_engine(engine_cfg, tokenizer, release_memory=False)
        parts.append(engine)
        if attached:  # a colocated run killed while it stepped left them asleep: they would neither load nor serve
            engine.wake_left_asleep()  # type: ignore[attr-defined]
            if folder is not None:
                engine.load_folder(Path(folder).absolute(), version=1)  # type: ignore[attr-defined]
        pool = None
        if any(s.kind == "env" or s.scorer == "code" for _, s in suites):  # these run in sandbox workers
            pool = SandboxPool(cfg.sandbox)
            parts.append(pool)
        return Evaluator(cfg, engine, tokenizer, pool, only=args.suite)

    try:
        if dist.is_initialized():  # a failure on rank 0 stops every rank, named (they would wait in the sync)
            from spade_mega.selfplay.loop import _from_rank0

            evaluator = _from_rank0(start, share=False)
        else:
            evaluator = start()
        if trainer is not None:
            from spade_mega.bridge import sync_weights

            sync_weights(trainer, parts[0] if parts else None, trainer.step)
            # the engine has the weights: the trainer's model and groups (its memory, on a GPU) go before it generates
            trainer.close()
            trainer = None
        if rank != 0:
            return 0
        assert evaluator is not None
        results = evaluator.evaluate()
    finally:
        try:
            for part in reversed(parts):
                part.close()
            if trainer is not None:  # the engine failed to start or to take the weights
                trainer.close()
        finally:  # after its server stopped writing into it
            for own, (fd, lock) in scratch:
                shutil.rmtree(own, ignore_errors=True)
                lock.unlink(missing_ok=True)
                os.close(fd)
    scored = f"{source['checkpoint']} (step {source['step']})" if "checkpoint" in source else source["hf_weights"]
    print(f"scored {scored}, run.seed {cfg.run.seed}")
    print(format_table(results))
    if args.output is not None:
        _write_json(Path(args.output), {"config": str(Path(args.config).absolute()), **source,
                                        "seed": cfg.run.seed,
                                        "suites": [{"name": r.name, "kind": r.kind, "metrics": r.metrics,
                                                    "details": r.details} for r in results]})
        print(f"wrote {args.output}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="score a checkpoint on the config's held-out suites (eval.suites)",
        description="Score a run's Megatron checkpoint (--checkpoint: a step_<N> folder or a checkpoints root, its "
                    "newest step) or a Hugging Face folder (--hf-weights; without either, the config's "
                    "inference.hf_weights) on the held-out suites of CONFIG's eval.suites, with the config's engine; "
                    "print a table, and write JSON with -o. Seeds derive from run.seed, so the same weights give the "
                    "same scores on the same engine. Whatever the engine, the weights named are scored: the in-process engine and a "
                    "server started here load them; servers it attaches to (inference.server_urls or "
                    "$SPADE_ENGINE_URLS) are made to load them first, a checkpoint through the bridge as training "
                    "syncs, an --hf-weights folder read by each server itself at its absolute path (a server on "
                    "another node needs it there: a shared file system); they serve them afterwards, so never "
                    "point it at the servers of a job still running. The engine never releases its memory "
                    "(inference.release_memory is for training). Under torchrun every rank loads its shards of the "
                    "checkpoint and rank 0 evaluates (with --hf-weights the other ranks exit at once).")
    parser.add_argument("config", metavar="CONFIG", help="YAML config (the run's: model, engine, eval.suites)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, values parsed as YAML: run.seed=7 'eval.suites=[{name: a}]'")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", metavar="DIR", help="a run's Megatron checkpoint (step folder or root)")
    weights.add_argument("--hf-weights", metavar="DIR",
                         help="a Hugging Face folder (config.json, *.safetensors); attached servers load it from "
                              "their own file system, at its absolute path")
    parser.add_argument("--suite", action="append", metavar="NAME",
                        help="score only this suite (repeat for several; default: all of eval.suites)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the metrics and per-item answers as JSON")
    parser.set_defaults(func=_eval)
