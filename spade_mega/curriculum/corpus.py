"""Corpus grounding: one document per designer prompt, so the designer's environments stay diverse.

SPADE's ablation: without a grounding document Vendi/n fell from 0.68 to 0.04 (the designer repeats one game).
Documents come from JSONL, Parquet, a Hugging Face dataset saved to disk (``save_to_disk``: Arrow stream files), a
folder of text files, or the built-in offline corpus (``builtin:maths|science|code``, see ``default_corpus.py``).
Each carries a domain label; a skill draws from its domains. Exact and near duplicates are dropped at load time.
Sampling is stateless and seeded by (seed, skill, iteration, slot), so a resumed run draws the same documents.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from spade_mega.config.schema import CorpusConfig, CorpusSourceConfig
from spade_mega.curriculum.fingerprint import MinHasher, shingles, tokens
from spade_mega.errors import SpadeError

TEXT_SUFFIXES = (".txt", ".md", ".rst")
FINGERPRINT_CHARS = 50_000  # near-duplicate detection looks at the head of each document


class CorpusError(SpadeError):
    """A corpus source cannot be read, or does not hold what the config says."""


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    text: str


@dataclass(frozen=True)
class GroundingDocument:
    """A sampled document, truncated to the token budget: what goes into one designer prompt."""

    id: str
    domain: str
    text: str
    num_tokens: int
    truncated: bool


@dataclass
class CorpusStats:
    loaded: int = 0
    too_short: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    per_domain: Counter = field(default_factory=Counter)


# ---------------------------------------------------------------------------------------------------- source readers

def _field(record: Any, name: str, where: str) -> Any:
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(f"{where}: no field {name!r} (record has: {keys}); set the source's text_field, "
                              "id_field or domain_field to the right name")
        value = value[part]
    return value


def _records(source: CorpusSourceConfig, fmt: str, path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, record) pairs from a JSONL, Parquet or saved Hugging Face dataset."""
    if fmt == "jsonl":
        try:
            fh = path.open("rb")
        except OSError as exc:
            raise CorpusError(f"{path}: cannot read it as a jsonl file ({exc.strerror}); give each .jsonl file as a "
                              "source of its own") from None
        with fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the "
                                      "line); re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield f"{path}:{lineno}", record
        return
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    columns = [c for c in (source.text_field, source.id_field, source.domain_field) if c]
    top = sorted({c.split(".")[0] for c in columns})
    if fmt == "parquet":
        try:
            tables: Iterable[tuple[Path, Any]] = [(path, pq.ParquetFile(path))]
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorpusError(f"{path}: not a readable Parquet file ({exc})") from None
        batches = ((p, b) for p, f in tables
                   for b in _guarded(p, f.iter_batches(columns=_existing(p, f.schema_arrow, top))))
    else:
        batches = ((p, b) for p in _arrow_files(path, source.split) for b in _arrow_batches(p))
    row = 0
    for file, batch in batches:
        _existing(file, batch.schema, top)
        for record in batch.to_pylist():
            row += 1
            yield f"{file}[row {row}]", record


def _guarded(path: Path, batches: Iterable[Any]) -> Iterator[Any]:
    """Record batches of one file; a damaged or truncated file is a CorpusError naming it, not a raw Arrow error."""
    import pyarrow as pa

    try:
        yield from batches
    except (pa.ArrowException, OSError) as exc:
        raise CorpusError(f"{path}: unreadable, the file is damaged or truncated ({exc})") from None


def _existing(path: Path, schema: Any, names: Sequence[str]) -> list[str]:
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise CorpusError(f"{path}: no column {missing[0]!r} (columns: {', '.join(schema.names)}); set the "
                          "source's text_field, id_field or domain_field to the right name")
    return list(names)


def _arrow_files(path: Path, split: str | None) -> list[Path]:
    """The Arrow files of a ``Dataset.save_to_disk`` folder, or of one split (or all) of a ``DatasetDict``."""
    if (path / "dataset_dict.json").is_file():
        splits = _dataset_state(path / "dataset_dict.json", "splits")
        if split is not None and split not in splits:
            raise CorpusError(f"{path}: no split {split!r} (splits: {', '.join(splits)})")
        return [f for s in ([split] if split else splits) for f in _arrow_files(path / s, None)]
    state = path / "state.json"
    if not state.is_file():
        raise CorpusError(f"{path}: not a dataset saved with save_to_disk (no state.json or dataset_dict.json)")
    entries = _dataset_state(state, "_data_files")
    try:
        return [path / entry["filename"] for entry in entries]
    except (KeyError, TypeError) as exc:
        raise CorpusError(f"{state}: unreadable dataset state ({exc!r})") from None


def _dataset_state(file: Path, key: str) -> Any:
    """``key`` of a ``save_to_disk`` JSON file; a damaged file is a CorpusError naming it."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))[key]
        if not isinstance(value, (list, dict)):
            raise TypeError(f"{key} is a {type(value).__name__}")
        return value
    except (KeyError, TypeError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise CorpusError(f"{file}: unreadable dataset state ({exc!r})") from None


def _arrow_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.ipc

    if not path.is_file():
        raise CorpusError(f"{path}: Arrow data file listed in state.json is missing")
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)  # what `datasets` writes
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as exc:
                raise CorpusError(f"{path}: not an Arrow stream or file ({exc})") from None
        yield from _guarded(path, reader)


def detect_format(path: str) -> str:
    if path.startswith("builtin:"):
        return "builtin"
    p = Path(path)
    if p.is_dir():
        return "hf_disk" if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file() else "text"
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in TEXT_SUFFIXES:
        return "text"
    raise CorpusError(f"{path}: cannot tell the format from the name; set the source's format "
                      "(jsonl, parquet, hf_disk, text or builtin)")


def load_source(source: CorpusSourceConfig) -> Iterator[Document]:
    """Every document of one configured source, in file order."""
    fmt = source.format if source.format != "auto" else detect_format(source.path)
    if fmt == "builtin":
        from spade_mega.curriculum.default_corpus import builtin_documents

        kind = source.path.removeprefix("builtin:")
        for doc_id, text in builtin_documents(kind):
            yield Document(f"builtin:{kind}:{doc_id}", source.domain, text)
        return
    path = Path(source.path).expanduser()
    if not path.exists():
        raise CorpusError(f"{path}: corpus source not found")
    if fmt == "text":
        files = sorted(f for f in path.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file()) \
            if path.is_dir() else [path]
        for f in files:
            doc_id = f"{path.name}/{f.relative_to(path).as_posix()}" if path.is_dir() else path.name
            yield Document(doc_id, source.domain, f.read_text(encoding="utf-8", errors="replace"))
        return
    for index, (where, record) in enumerate(_records(source, fmt, path)):
        text = _field(record, source.text_field, where)
        if not isinstance(text, str):
            raise CorpusError(f"{where}: field {source.text_field!r} must be text, got {type(text).__name__}")
        doc_id = str(_field(record, source.id_field, where)) if source.id_field else str(index)
        domain = str(_field(record, source.domain_field, where)) if source.domain_field else source.domain
        yield Document(f"{path.name}:{doc_id}", domain, text)


# ------------------------------------------------------------------------------------------------------- the corpus

class Corpus:
    """Deduplicated documents, indexed by domain."""

    def __init__(self, documents: Sequence[Document], stats: CorpusStats | None = None) -> None:
        self.documents = list(documents)
        self.stats = stats or CorpusStats(loaded=len(self.documents),
                                          per_domain=Counter(d.domain for d in self.documents))
        self._by_domain: dict[str, list[int]] = {}
        for i, doc in enumerate(self.documents):
            self._by_domain.setdefault(doc.domain, []).append(i)

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def domains(self) -> list[str]:
        return sorted(self._by_domain)

    def indices(self, domains: Sequence[str]) -> list[int]:
        """Document indices in any of ``domains`` (all documents for an empty list)."""
        if not domains:
            return list(range(len(self.documents)))
        return [i for d in domains for i in self._by_domain.get(d, [])]

    @classmethod
    def build(cls, cfg: CorpusConfig, progress: bool = False) -> "Corpus":
        """Load every source and drop short, exactly duplicated and near-duplicated documents."""
        stats = CorpusStats()
        kept: list[Document] = []
        exact: set[bytes] = set()
        hasher = MinHasher(num_perm=64, bands=16)
        buckets: dict[int, list[Any]] = {}
        for index, source in enumerate(cfg.sources):
            docs: Iterable[Document] = load_source(source)
            read_before, short_before = stats.loaded, stats.too_short
            if progress:
                from rich.progress import track

                docs = track(docs, description=f"corpus {source.path}", transient=True)
            for doc in docs:
                stats.loaded += 1
                if len(doc.text.strip()) < cfg.min_chars:
                    stats.too_short += 1
                    continue
                words = doc.text[:FINGERPRINT_CHARS].lower().split()
                digest = hashlib.sha256(" ".join(words).encode("utf-8")).digest()
                if cfg.dedup and digest in exact:
                    stats.exact_duplicates += 1
                    continue
                if cfg.dedup:
                    sig = hasher.signature(shingles(tokens(doc.text[:FINGERPRINT_CHARS])))
                    keys = hasher.band_keys(sig)
                    if any(hasher.similarity(sig, other) >= cfg.near_duplicate_threshold
                           for key in keys for other in buckets.get(key, ())):
                        stats.near_duplicates += 1
                        continue
                    exact.add(digest)
                    for key in keys:
                        buckets.setdefault(key, []).append(sig)
                kept.append(doc)
                stats.per_domain[doc.domain] += 1
            if stats.loaded == read_before:
                raise CorpusError(f"curriculum.corpus.sources[{index}] ({source.path}): no documents in this source "
                                  f"(text folders are searched for {', '.join(TEXT_SUFFIXES)} files); fix the path or "
                                  "remove the source")
            if stats.too_short - short_before == stats.loaded - read_before:
                raise CorpusError(f"curriculum.corpus.sources[{index}] ({source.path}): all "
                                  f"{stats.loaded - read_before} documents are shorter than min_chars "
                                  f"({cfg.min_chars}); is text_field ({source.text_field!r}) the field that holds the "
                                  "text?")
        if not kept:
            raise CorpusError("curriculum.corpus.sources: no documents left after loading "
                              f"({stats.loaded} read, {stats.too_short} shorter than min_chars)")
        return cls(kept, stats)


# ------------------------------------------------------------------------------------------------------ truncation

def count_tokens(tokenizer: Any, text: str) -> int:
    if hasattr(tokenizer, "encode_batch"):  # a bare `tokenizers.Tokenizer`
        return len(tokenizer.encode(text, add_special_tokens=False).ids)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _token_end_offsets(tokenizer: Any, text: str) -> list[int] | None:
    """End character offset of every token, when the tokenizer reports offsets (fast tokenizers do)."""
    try:
        if hasattr(tokenizer, "encode_batch"):
            offsets = tokenizer.encode(text, add_special_tokens=False).offsets
        else:
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        return None
    return [end for _, end in offsets]


def truncate_to_tokens(tokenizer: Any, text: str, budget: int) -> tuple[str, int, bool]:
    """The longest prefix of ``text`` (cut at a word boundary when one is near) with at most ``budget`` tokens.

    Returns (text, token count, truncated). The count is re-measured on the returned text itself, so the budget
    holds even where a tokenizer merges differently across the cut.
    """
    total = count_tokens(tokenizer, text)
    if total <= budget:
        return text, total, False
    ends = _token_end_offsets(tokenizer, text)
    cut = ends[budget - 1] if ends and len(ends) > budget else int(len(text) * budget / total)
    while True:
        space = text.rfind(" ", max(0, cut - 200), cut + 1)
        piece = text[:space if space > 0 else cut].rstrip()
        n = count_tokens(tokenizer, piece)
        if n <= budget:
            return piece, n, True
        cut = min(cut - 1, int(cut * budget / n))


class GroundingSampler:
    """Draws a truncated grounding document for a skill; stateless, so it is reproducible and resume-exact."""

    def __init__(self, corpus: Corpus, skill_domains: dict[str, list[str]], tokenizer: Any, token_budget: int,
                 seed: int) -> None:
        self.corpus, self.tokenizer, self.token_budget, self.seed = corpus, tokenizer, token_budget, seed
        self._pool: dict[str, list[int]] = {}
        for skill, domains in skill_domains.items():
            pool = corpus.indices(domains)
            if not pool:
                raise CorpusError(f"skill {skill!r} draws from domains {domains} but the corpus has none of them "
                                  f"(corpus domains: {', '.join(corpus.domains)}); add a source with one of these "
                                  "domains or change the skill's domains")
            self._pool[skill] = pool

    def sample(self, skill: str, iteration: int, slot: int) -> GroundingDocument:
        if skill not in self._pool:
            raise CorpusError(f"unknown skill {skill!r} (known: {', '.join(self._pool)})")
        rng = random.Random(f"{self.seed}:{skill}:{iteration}:{slot}")
        doc = self.corpus.documents[rng.choice(self._pool[skill])]
        text, n, truncated = truncate_to_tokens(self.tokenizer, doc.text, self.token_budget)
        return GroundingDocument(doc.id, doc.domain, text, n, truncated)
