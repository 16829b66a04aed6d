"""Generates text from a GPT checkpoint (model=gpt, byte tokens).

    python -m sample outputs/2026-12-02/02-10-00                     # a run folder: its newest checkpoint
    python -m sample outputs/.../checkpoints/600 --prompt "ROMEO:" --tokens 400 --temperature 0.8 --seed 1

The model comes from the config saved with the checkpoint (``<step>/meta/metadata``), its parameters from the
checkpoint's ``params`` (any device count or mode saved them: they are read as host arrays). ``--temperature 0``
(the default) is greedy decoding; > 0 samples from ``softmax(logits / temperature)`` with ``--seed``. The
prompt is UTF-8 encoded to byte tokens; the output bytes are decoded with replacement characters where a
multi-byte character is cut. Output: the prompt and its continuation on stdout. A damaged newest step (a missing or
truncated file) is named in one warning line and the newest complete step is used. Errors (no complete checkpoint,
not a GPT, arrays that do not fit the saved config, a bad argument): one line ``error: ...`` on stderr and exit
code 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional, Sequence


def load_newest(path: Path):
    """``(the GPT, its step folder)`` of :func:`load_model` for ``path``: one step folder, or the newest complete step
    of a checkpoint folder or of a run folder's checkpoints (a damaged newer one is named in one warning line).
    Raises ConfigError when there is none (one line)."""
    from evaluate import find_steps, nothing_left
    from training import checkpoint

    step_dirs, folder = find_steps(Path(path))
    return checkpoint.read_newest(step_dirs, load_model, "sampling", nothing_left(step_dirs, folder, "sample"))


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
                raise ConfigError(f"checkpoint {step_dir} has no array {key}; it does not hold this config's GPT")
            have, want = tuple(arrays[name].shape), tuple(v.shape)
            if have != want:
                if key in tables:
                    found = f"the GPT {tables[key]} has {have[0]} rows in its arrays but {want[0]}"
                else:
                    found = f"array {key} has shape {have} but {want}"
                raise ConfigError(
                    f"checkpoint {step_dir}: {found} in its saved config (model.vocab_size / model.context / "
                    f"model.max_positions); sample it with the config it was trained with (its .hydra/config.yaml)"
                )
            tree[k] = jnp.asarray(arrays[name])

    fill(pure, "params")
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def sample_text(model, prompt: str, num_tokens: int, temperature: float = 0.0, seed: int = 0) -> str:
    """``prompt`` + its continuation of ``num_tokens`` byte tokens, decoded as UTF-8 (with replacement)."""
    from models.gpt import generate

    tokens = generate(model, list(prompt.encode("utf-8")), num_tokens, temperature=temperature, seed=seed)
    return prompt + bytes(tokens).decode("utf-8", errors="replace")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sample", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a run folder, a checkpoint folder or one <step> folder")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokens", type=int, default=300, help="bytes to generate (default 300)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    args = parser.parse_args(argv)
    from core.errors import USER_ERRORS
    from training.console import tool_logging

    tool_logging()

    try:
        if args.tokens < 0:
            raise ValueError(f"--tokens {args.tokens} must be >= 0")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise ValueError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
        model, step_dir = load_newest(Path(args.path))
        vocab = int(model.embed.embedding.shape[0])
        outside = sorted({b for b in args.prompt.encode("utf-8") if b >= vocab})
        if outside:
            raise ValueError(
                f"--prompt {args.prompt!r} has byte values {outside} outside the model's vocabulary of {vocab} "
                f"tokens; use a prompt of bytes below {vocab}"
            )
        how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seed {args.seed}"
        print(f"sample: {step_dir}, prompt {args.prompt!r}, {args.tokens} bytes, {how}", file=sys.stderr, flush=True)
        print(sample_text(model, args.prompt, args.tokens, args.temperature, args.seed))
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
