"""Tiny local tokenizer and dataset for CPU runs and tests: nothing is downloaded.

The text is generated from a small grammar, so a tiny MPT can learn it (loss falls well below
ln(vocab)) in a few dozen batches. The tokenizer is a byte-level BPE trained on that text and
saved as a `PreTrainedTokenizerFast`; the dataset is MDS shards of raw text that LLM-Foundry's
`text` dataloader tokenizes itself. Both are cached: a second call with the same settings reuses
them while they are whole (the tokenizer loads, each split's index parses and its shards are
there at the sizes it names), else rebuilds them, deleting only the MDS files an earlier
(killed) build left under ROOT. Builds in parallel take turns on ROOT/.build.lock; one that
waits says so once.

Run as `foundry-fp8 tiny-data DATA_ROOT` (or `python -m foundry_fp8.tools.tiny_data`) to build
them; `make run` and the tests do.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from foundry_fp8.jsonl import file_kind

_ADJECTIVES = ["red", "quick", "lazy", "small", "bright", "quiet", "heavy", "cold", "old", "new"]
_NOUNS = ["fox", "dog", "cat", "bird", "tree", "river", "stone", "house", "road", "cloud"]
_VERBS = ["sees", "jumps over", "follows", "finds", "carries", "watches", "passes", "hides"]
_ENDINGS = ["today", "at night", "in the rain", "by the sea", "again", "slowly"]


@dataclass(frozen=True)
class TinyData:
    """Where the tiny tokenizer and MDS dataset live."""

    root: Path
    vocab_size: int
    num_samples: int

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / f"tokenizer-v{self.vocab_size}"

    @property
    def data_dir(self) -> Path:
        return self.root / f"text-{self.num_samples}"


def generate_text(rng: random.Random, sentences: int) -> str:
    """Sentences from a fixed grammar: learnable structure with some randomness."""
    out = []
    for _ in range(sentences):
        out.append(
            f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
            f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_ENDINGS)}."
        )
    return " ".join(out)


def _build_tokenizer(path: Path, vocab_size: int, corpus: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bars print blank lines where stdout is no terminal
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(str(path))


SPLITS = ("train", "val")


def _build_dataset(path: Path, corpus: list[str]) -> None:
    from streaming import MDSWriter

    for split in SPLITS:
        texts = corpus if split == "train" else corpus[: max(8, len(corpus) // 8)]
        with MDSWriter(out=str(path / split), columns={"text": "str"}, compression=None) as out:
            for text in texts:
                out.write({"text": text})


class TinyDataError(Exception):
    """What is in the way of a usable build, naming the path: one line for the CLI."""


def _folders_in_the_way(data: TinyData) -> None:
    """A file where a folder of the build goes (ROOT, or one of its parents, the tokenizer or
    dataset folder, a split) fails here, naming it: Hugging Face only logs that it saved
    nothing, and the OS's "Not a directory" names whichever path was being opened."""
    for folder in (data.tokenizer_dir, *(data.data_dir / split for split in SPLITS)):
        for path in (*reversed(folder.parents), folder):
            if path.exists() and not path.is_dir():
                raise TinyDataError(f"{path}: is {file_kind(path.stat().st_mode)}, where "
                                    "tiny-data needs a folder (move it away, or build in "
                                    "another ROOT)")


def _split_problem(folder: Path) -> str | None:
    """Why an MDS split folder does not load, or None: its index.json is missing or is no MDS
    index (empty, cut short), or a shard it names is missing or of another size."""
    index = folder / "index.json"
    if not index.is_file():
        return f"{index}: not written"
    try:
        shards = [(shard["raw_data"]["basename"], shard["raw_data"]["bytes"])
                  for shard in json.loads(index.read_bytes())["shards"]]
    except OSError as err:
        return f"{index}: cannot read ({err.strerror or err})"
    except (ValueError, TypeError, KeyError, RecursionError) as err:  # JSON, or its shape
        return f"{index}: not an MDS index ({type(err).__name__}: {err})"
    if not shards:
        return f"{index}: names no shard"
    for basename, size in shards:
        shard = folder / str(basename)
        if not shard.is_file():
            return f"{shard}: missing ({index} names it)"
        if shard.stat().st_size != size:
            return f"{shard}: {shard.stat().st_size} bytes, where {index} names {size}"
    return None


def _unusable(data: TinyData) -> str | None:
    """What is missing or broken in a build, or None: the tokenizer loads and both splits'
    MDS indexes parse and name shards that are there (`_split_problem`)."""
    from tokenizers import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (data.tokenizer_dir / name).is_file():
            return f"{data.tokenizer_dir / name}: not written"
    try:
        Tokenizer.from_file(str(data.tokenizer_dir / "tokenizer.json"))
    except Exception as err:  # tokenizers raises a bare Exception for a corrupt file
        return f"{data.tokenizer_dir / 'tokenizer.json'}: does not load ({err})"
    return next(filter(None, (_split_problem(data.data_dir / split) for split in SPLITS)), None)


#: What MDSWriter writes into a split folder, uncompressed as we write: the index and shards.
_MDS_FILE = re.compile(r"index\.json|shard\.\d{5}\.mds")


def _clear_split(data: TinyData, folder: Path) -> None:
    """Empty a split folder an earlier build wrote (maybe killed mid-write), as MDSWriter
    refuses to write into a folder that is not empty. Only the files MDSWriter writes are
    deleted, and only in a folder under ROOT: a link out of it, or any other file, is a
    TinyDataError naming it, and nothing is deleted."""
    if not folder.exists():
        return
    if folder.resolve() != folder:  # ROOT is resolved: a link below it leads elsewhere
        raise TinyDataError(f"{folder}: leads out of {data.root} (a symbolic link); tiny-data "
                            "rebuilds only folders it made there (remove it, or build in "
                            "another ROOT)")
    entries = sorted(folder.iterdir())
    foreign = [p for p in entries
               if not (_MDS_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink())]
    if foreign:
        raise TinyDataError(f"{foreign[0]}: not a file tiny-data writes, in a dataset folder "
                            "it must rebuild (move it away, or build in another ROOT)")
    for path in entries:
        path.unlink()


def _whole(data: TinyData, marker: Path) -> bool:
    """The build is marked ready and still whole. The marker is looked at again after the
    check: a build in progress removes it before touching any file, so it still being there
    means no build changed the files while they were checked (no lock needed)."""
    return marker.exists() and _unusable(data) is None and marker.exists()


#: Seconds to wait quietly for another build's lock before saying so.
QUIET_WAIT_S = 1.0


def prepare_tiny_data(root: str | Path, vocab_size: int = 512, num_samples: int = 2048,
                      seed: int = 0, waiting: Callable[[str], None] | None = None) -> TinyData:
    """Build (or reuse) the tiny tokenizer and dataset under `root`. A build is reused only
    while it is whole, even while another process holds the build lock; one that broke (a
    killed build's partial split included) is rebuilt; the marker file is written only after
    the build was checked. Waiting for another process's build, `waiting` gets one line saying
    so. Raises TinyDataError (or OSError) when it cannot be made."""
    data = TinyData(Path(root).resolve(), vocab_size, num_samples)
    from filelock import FileLock, Timeout

    _folders_in_the_way(data)
    marker = data.root / f"ready-v{vocab_size}-{num_samples}-{seed}.json"
    if _whole(data, marker):
        return data
    data.root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(data.root / ".build.lock"))  # parallel builds make it once
    try:
        lock.acquire(timeout=QUIET_WAIT_S)
    except Timeout:
        if waiting is not None:
            waiting(f"waiting for another tiny-data build in {data.root} to finish (it holds "
                    f"{lock.lock_file}) ...")
        lock.acquire()
    try:
        if _whole(data, marker):  # the build we waited for
            return data
        marker.unlink(missing_ok=True)
        for split in SPLITS:
            _clear_split(data, data.data_dir / split)
        rng = random.Random(seed)
        corpus = [generate_text(rng, sentences=12) for _ in range(num_samples)]
        _build_tokenizer(data.tokenizer_dir, vocab_size, corpus)
        _build_dataset(data.data_dir, corpus)
        problem = _unusable(data)
        if problem is not None:
            raise TinyDataError(f"the build failed: {problem}")
        marker.write_text(json.dumps({**asdict(data), "root": str(data.root), "seed": seed}))
    finally:
        lock.release()
    return data


DESCRIPTION = """Build, under ROOT, what a CPU try of LLM-Foundry needs without any download:
ROOT/tokenizer-v512/, a byte-level BPE tokenizer (512 tokens, saved as a Hugging Face
PreTrainedTokenizerFast, for `tokenizer.name`), and ROOT/text-2048/{train,val}/, MDS shards of
2048 generated sentence samples (for the `text` loader's `dataset.local`). The text follows a
small grammar, so a tiny MPT learns it in a few dozen batches. A second run reuses them (if they
are whole; a broken or partly written build is rebuilt). A file where one of these folders goes,
or a file tiny-data did not write in a dataset folder it must rebuild, is an error naming it,
exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("root", nargs="?", default=Path("data"), type=_root, metavar="ROOT",
                        help="folder to build into, created if missing (default: ./data)")


def _root(value: str) -> Path:
    """ROOT as given; an empty one (`tiny-data "$DATA"` with DATA unset) is refused: it would
    build into the current folder."""
    if not value:
        raise argparse.ArgumentTypeError("empty; give the folder to build into (default: ./data)")
    return Path(value)


def run(args: argparse.Namespace) -> int:
    from foundry_fp8.health.table import one_line

    print(f"building the tiny tokenizer and dataset in {one_line(str(args.root))} ...", flush=True)
    def waiting(message: str) -> None:
        print(f"foundry-fp8 tiny-data: {one_line(message)}", file=sys.stderr, flush=True)

    try:
        data = prepare_tiny_data(args.root, waiting=waiting)
    except TinyDataError as err:
        print(f"foundry-fp8 tiny-data: {one_line(str(err))}", file=sys.stderr)
        return 2
    except OSError as err:
        where = err.filename if err.filename is not None else args.root
        print(f"foundry-fp8 tiny-data: {one_line(str(where))}: {err.strerror or err}",
              file=sys.stderr)
        return 2
    tokenizer = _flow({"name": str(data.tokenizer_dir)})
    loader = _flow({"name": "text", "dataset": {"local": str(data.data_dir), "split": "train"}})
    print(f"tokenizer: {one_line(str(data.tokenizer_dir))}  (tokenizer: {tokenizer})\n"
          f"dataset:   {one_line(str(data.data_dir))}  (train_loader: {loader})")
    return 0


def _flow(value: dict[str, object]) -> str:
    """`value` as one line of YAML to paste: a path with `: `, ` #` or a quote is quoted, where
    writing it as is would give another value (or none) when the YAML loads; a string with a
    line break is double-quoted, `\\n` escaped, so the snippet stays on its line (YAML's single
    quotes fold it over lines). Only strings: `default_style='"'` would tag other values
    (`!!int "5"`)."""
    import yaml

    class OneLine(yaml.SafeDumper):
        """SafeDumper, with a string holding a line break double-quoted."""

    OneLine.add_representer(str, lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style='"' if "\n" in text else None))
    return yaml.dump(value, Dumper=OneLine, default_flow_style=True, sort_keys=False,
                     width=float("inf")).strip()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m foundry_fp8.tools.tiny_data")
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
