"""Generates text from a GPT checkpoint (model=gpt; byte tokens, or the BPE / tokenizer file it was trained with).

    python -m sample outputs/2026-12-02/02-10-00                     # a run folder: its newest checkpoint
    python -m sample outputs/.../checkpoints/600 --prompt "ROMEO:" --tokens 400 --temperature 0.8 --seed 1
    python -m sample outputs/2026-12-02/02-10-00 --best              # the best checkpoint (checkpoint.keep_best)

The model comes from the config saved with the checkpoint (``<step>/meta/metadata``), its parameters from the
checkpoint's ``params`` (any device count or mode saved them: they are read as host arrays). ``--temperature 0``
(the default) is greedy decoding; > 0 samples from ``softmax(logits / temperature)`` with ``--seed``. The
prompt is encoded with the run's tokenizer (byte tokens: its UTF-8 bytes; a BPE: the ``tokenizer.json`` saved
beside the checkpoint) and the output decoded with it (a multi-byte character cut short becomes U+FFFD).
Output: the prompt and its continuation on stdout. A damaged newest step (a missing or truncated file, arrays that
no longer fit its saved config) is named in one warning line and the newest complete step is used. Errors (no
complete checkpoint, not a GPT, a bad argument): one line ``error: ...`` on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional, Sequence


def find_checkpoint(path: Path, best: bool = False) -> Path:
    """A step folder: ``path`` itself, the newest in ``path`` (a checkpoint folder) or in its run folder's
    checkpoints; ``best``: the run's best checkpoint (``evaluate.find_best_step_dir``). Raises ConfigError when
    there is none."""
    from evaluate import find_best_step_dir, find_step_dir

    return find_best_step_dir(Path(path)) if best else find_step_dir(Path(path))


def load_newest(path: Path, best: bool = False):
    """``(the GPT, its step folder)`` of :func:`load_model` for ``path``: one step folder, or the newest complete step
    of a checkpoint folder or of a run folder's checkpoints (a damaged newer one is named in one warning line);
    ``best``: the run's best checkpoint. Raises ConfigError when there is none (one line)."""
    from evaluate import find_best_step_dir, find_steps, nothing_left
    from training import checkpoint

    step_dirs, folder = ([find_best_step_dir(Path(path))], None) if best else find_steps(Path(path))
    advice = nothing_left(step_dirs, folder, "sample")
    return checkpoint.read_newest(step_dirs, load_model, "sampling", advice, misfit_damaged=True)


def load_model(step_dir: Path):
    """The GPT of the checkpoint at ``step_dir`` with its saved parameters. Raises ConfigError (one line) for
    another model, or arrays whose shapes differ from the saved config's GPT (e.g. its vocabulary or position
    table: the line names both sizes)."""
    import jax.numpy as jnp
    from flax import nnx

    from conf.schema import from_dict
    from core.errors import ConfigError
    from models import build_model
    from training import checkpoint
    from training.build import model_kwargs

    saved = checkpoint.read_metadata(step_dir).get("config", {})
    name = (saved.get("model") or {}).get("name")
    if name != "gpt":
        raise ConfigError(f"checkpoint {step_dir} holds model={name}; sampling needs a model=gpt checkpoint")
    cfg = from_dict(saved, lenient=True)
    model = build_model("gpt", (), 0, seed=cfg.train.seed, **model_kwargs(cfg.model))
    arrays = checkpoint.read_arrays(step_dir)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)

    tables = {"params.embed.embedding": "vocabulary", "params.pos_embed": "position table"}

    def fill(tree, prefix):
        for k, v in tree.items():
            key = f"{prefix}.{k}"
            if isinstance(v, dict):
                fill(v, key)
                continue
            name = f"{key}.value" if f"{key}.value" in arrays else key
            if name not in arrays:
                raise checkpoint.Misfit(
                    f"checkpoint {step_dir} has no array {key}; it does not hold this config's GPT",
                    f"no array {key} for its config's GPT",
                )
            have, want = tuple(arrays[name].shape), tuple(v.shape)
            if have != want:
                if key in tables:
                    found = f"the GPT {tables[key]} has {have[0]} rows in its arrays but {want[0]}"
                else:
                    found = f"array {key} has shape {have} but {want}"
                raise checkpoint.Misfit(
                    f"checkpoint {step_dir}: {found} in its saved config (model.vocab_size / model.context / "
                    f"model.max_positions); sample it with the config it was trained with (its .hydra/config.yaml)",
                    f"{found} by its config",
                )
            tree[k] = jnp.asarray(arrays[name])

    fill(pure, "params")
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def load_tokenizer(step_dir: Path):
    """The tokenizer the checkpoint at ``step_dir`` was trained with: bytes for ``data.tokenizer=bytes`` (and a
    config without the key); else the ``tokenizer.json`` saved beside it (``training.checkpoint.tokenizer_beside``),
    else the config's ``data.tokenizer_file``. Raises ConfigError / DataError (one line) when it cannot be found."""
    from core.errors import ConfigError
    from data.tokens import ByteTokenizer, load_tokenizer_file
    from training import checkpoint

    data = checkpoint.read_metadata(step_dir).get("config", {}).get("data", {})
    if data.get("tokenizer", "bytes") == "bytes" and not data.get("tokenizer_file"):
        return ByteTokenizer()
    saved = checkpoint.tokenizer_beside(step_dir)
    if saved is not None:
        return load_tokenizer_file(saved, "the run's saved tokenizer")
    if data.get("tokenizer_file"):
        return load_tokenizer_file(Path(data["tokenizer_file"]))
    raise ConfigError(
        f"checkpoint {step_dir} was trained on data.tokenizer={data.get('tokenizer')} tokens, but no tokenizer.json is "
        f"beside it ({step_dir.parent}) nor in its run folder; copy the run's tokenizer.json into {step_dir.parent}"
    )


def sample_text(model, prompt: str, num_tokens: int, temperature: float = 0.0, seed: int = 0, tokenizer=None) -> str:
    """``prompt`` + its continuation of ``num_tokens`` tokens, decoded by ``tokenizer`` (None: byte tokens, as
    UTF-8 with replacement)."""
    from data.tokens import ByteTokenizer
    from models.gpt import generate

    tokenizer = tokenizer or ByteTokenizer()
    ids = [int(i) for i in tokenizer.encode(prompt)]
    tokens = generate(model, ids, num_tokens, temperature=temperature, seed=seed)
    return prompt + tokenizer.decode(tokens)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sample", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a run folder, a checkpoint folder or one <step> folder")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens to generate (bytes for byte tokens; 300)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument(
        "--best", action="store_true", help="the best checkpoint (checkpoint.keep_best) instead of the newest"
    )
    args = parser.parse_args(argv)
    from core.errors import USER_ERRORS
    from training.console import tool_logging

    tool_logging()

    try:
        if args.tokens < 0:
            raise ValueError(f"--tokens {args.tokens} must be >= 0")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise ValueError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
        model, step_dir = load_newest(Path(args.path), best=args.best)
        tokenizer = load_tokenizer(step_dir)
        vocab = int(model.embed.embedding.shape[0])
        if not args.prompt:
            raise ValueError("--prompt is empty; give at least one character (default: a newline)")
        outside = sorted({int(b) for b in tokenizer.encode(args.prompt) if b >= vocab})
        if outside:
            what = "byte values" if tokenizer.name == "bytes" else "tokens"
            raise ValueError(
                f"--prompt {args.prompt!r} has {what} {outside} outside the model's vocabulary of {vocab} "
                f"tokens; use a prompt of {'bytes' if tokenizer.name == 'bytes' else 'tokens'} below {vocab}"
            )
        how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seed {args.seed}"
        unit = "bytes" if tokenizer.name == "bytes" else f"tokens ({tokenizer.name}, vocabulary {tokenizer.vocab_size})"
        print(f"sample: {step_dir}, prompt {args.prompt!r}, {args.tokens} {unit}, {how}", file=sys.stderr, flush=True)
        print(sample_text(model, args.prompt, args.tokens, args.temperature, args.seed, tokenizer))
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from measure.address_space import limit_malloc_arenas
    from training import process

    limit_malloc_arenas()  # under ulimit -v, before JAX's threads start
    process.run_tool(main)
