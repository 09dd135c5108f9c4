"""Corpus grounding: every source format, dedup, reproducible sampling, token-budget truncation."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spade_mega.config.schema import CorpusConfig, CorpusSourceConfig
from spade_mega.curriculum.corpus import (Corpus, CorpusError, GroundingSampler, count_tokens, load_source,
                                          truncate_to_tokens)
from spade_mega.curriculum.default_corpus import builtin_documents
from spade_mega.tokenizer import byte_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def text(i: int, n: int = 80) -> str:
    """Distinct documents: a different word walk per i."""
    return " ".join(WORDS[(i * 7 + k * (i % 5 + 1) + k * k) % len(WORDS)] + str((k * i) % 13) for k in range(n))


RECORDS = [{"body": text(i), "meta": {"uid": f"u{i}"}, "area": "maths" if i % 2 else "science"} for i in range(6)]


def src(path: Path | str, **kw) -> CorpusSourceConfig:
    return CorpusSourceConfig(path=str(path), domain=kw.pop("domain", "code"), text_field=kw.pop("text_field", "body"),
                              **kw)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_to_disk(folder: Path, records: list[dict], shards: int = 2) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow *stream* files listed in state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(records)
    files = []
    per = -(-len(records) // shards)
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(s * per, per))
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "x", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def expected_ids(prefix: str) -> list[str]:
    return [f"{prefix}:u{i}" for i in range(6)]


def test_jsonl_with_dotted_id_and_domain_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", RECORDS)
    docs = list(load_source(src(path, id_field="meta.uid", domain_field="area")))
    assert [d.id for d in docs] == expected_ids("docs.jsonl")
    assert [d.domain for d in docs] == [r["area"] for r in RECORDS] and docs[3].text == RECORDS[3]["body"]


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path, row_group_size=2)
    docs = list(load_source(src(path, id_field="meta.uid")))
    assert [d.id for d in docs] == expected_ids("docs.parquet") and docs[5].text == RECORDS[5]["body"]
    assert {d.domain for d in docs} == {"code"}


def test_hf_dataset_saved_to_disk_and_dataset_dict(tmp_path: Path) -> None:
    ds = save_to_disk(tmp_path / "ds", RECORDS)
    docs = list(load_source(src(ds, id_field="meta.uid", domain_field="area")))
    assert [d.id for d in docs] == expected_ids("ds") and docs[0].domain == "science"
    dd = tmp_path / "dd"
    save_to_disk(dd / "train", RECORDS[:4])
    save_to_disk(dd / "test", RECORDS[4:], shards=1)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert len(list(load_source(src(dd)))) == 6
    assert [d.text for d in load_source(src(dd, split="test"))] == [r["body"] for r in RECORDS[4:]]
    with pytest.raises(CorpusError, match="no split 'valid'"):
        list(load_source(src(dd, split="valid")))


def test_text_folder(tmp_path: Path) -> None:
    (tmp_path / "notes" / "sub").mkdir(parents=True)
    (tmp_path / "notes" / "a.md").write_text(text(1))
    (tmp_path / "notes" / "sub" / "b.txt").write_text(text(2))
    (tmp_path / "notes" / "skip.bin").write_bytes(b"\x00\x01")
    docs = list(load_source(CorpusSourceConfig(path=str(tmp_path / "notes"), domain="science")))
    assert [d.id for d in docs] == ["notes/a.md", "notes/sub/b.txt"] and docs[1].text == text(2)
    single = list(load_source(CorpusSourceConfig(path=str(tmp_path / "notes" / "a.md"), domain="maths")))
    assert [(d.id, d.domain, d.text) for d in single] == [("a.md", "maths", text(1))]


def test_bad_sources_name_the_problem(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(CorpusError, match=r"d.jsonl:1: no field 'text' \(record has: area, body, meta\)"):
        list(load_source(src(path, text_field="text")))
    (tmp_path / "bad.jsonl").write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    with pytest.raises(CorpusError, match="bad.jsonl:2: invalid JSON"):
        list(load_source(src(tmp_path / "bad.jsonl")))
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "d.parquet")
    with pytest.raises(CorpusError, match="no column 'content'"):
        list(load_source(src(tmp_path / "d.parquet", text_field="content")))
    with pytest.raises(CorpusError, match="not found"):
        list(load_source(src(tmp_path / "absent.jsonl")))
    with pytest.raises(CorpusError, match="cannot tell the format"):
        list(load_source(src(tmp_path / "d.csv")))
    with pytest.raises(CorpusError, match="unknown built-in corpus"):
        list(load_source(src("builtin:poetry")))


def test_build_drops_short_exact_and_near_duplicates(tmp_path: Path) -> None:
    near = text(3).replace("alpha", "ALPHA!", 1) + " extra"
    records = [{"body": text(i)} for i in range(5)] + [{"body": "  " + text(1).upper() + "\n"}, {"body": near},
                                                      {"body": "too short"}]
    cfg = CorpusConfig(sources=[src(write_jsonl(tmp_path / "d.jsonl", records))], min_chars=50)
    corpus = Corpus.build(cfg)
    s = corpus.stats
    assert (s.loaded, s.too_short, s.exact_duplicates, s.near_duplicates, len(corpus)) == (8, 1, 1, 1, 5)
    assert [d.text for d in corpus.documents] == [text(i) for i in range(5)]
    no_dedup = Corpus.build(CorpusConfig(sources=cfg.sources, min_chars=50, dedup=False))
    assert len(no_dedup) == 7


def test_sampling_is_reproducible_for_a_seed_and_follows_skill_domains(tmp_path: Path) -> None:
    records = [{"body": text(i), "area": ["maths", "science", "code"][i % 3]} for i in range(30)]
    cfg = CorpusConfig(sources=[src(write_jsonl(tmp_path / "d.jsonl", records), domain_field="area")], min_chars=10)
    corpus = Corpus.build(cfg)
    domains = {"arithmetic": ["maths"], "science": ["science"], "tool_use": ["code", "maths"], "any": []}
    tok = byte_tokenizer()

    def draws(seed: int) -> list[str]:
        sampler = GroundingSampler(corpus, domains, tok, 10_000, seed)
        return [sampler.sample(skill, it, slot).id for skill in domains for it in range(4) for slot in range(3)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    sampler = GroundingSampler(corpus, domains, tok, 10_000, 7)
    assert {sampler.sample("arithmetic", it, 0).domain for it in range(20)} == {"maths"}
    assert {sampler.sample("tool_use", it, 0).domain for it in range(40)} == {"code", "maths"}
    with pytest.raises(CorpusError, match="draws from domains \\['poetry'\\]"):
        GroundingSampler(corpus, {"odes": ["poetry"]}, tok, 100, 0)


@pytest.fixture(scope="module")
def code_docs() -> list[str]:
    return [t for _, t in builtin_documents("code")]


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory, code_docs: list[str]):
    """A real BPE tokenizer, trained here on the standard library's docstrings and saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    training = code_docs[:150]
    core = Tokenizer(models.BPE(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(training, trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    core.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


@pytest.mark.parametrize("budget", [1, 7, 64, 300, 1000])
def test_truncation_respects_the_budget_for_a_real_bpe_tokenizer(bpe_tokenizer, code_docs, budget: int) -> None:
    docs = [t for _, (_, t) in zip(range(5), builtin_documents("maths"))] + code_docs[150:155]
    for doc in docs + ["é€😀 " * 400]:
        out, n, truncated = truncate_to_tokens(bpe_tokenizer, doc, budget)
        real = len(bpe_tokenizer.encode(out, add_special_tokens=False))
        assert n == real <= budget
        assert doc.startswith(out)
        full = count_tokens(bpe_tokenizer, doc)
        assert truncated == (full > budget)
        if truncated and budget >= 64:
            assert real >= 0.8 * budget  # fills the budget, not a crude under-estimate
    out, n, truncated = truncate_to_tokens(bpe_tokenizer, "short text", 100)
    assert (out, truncated) == ("short text", False) and n == count_tokens(bpe_tokenizer, "short text")


def test_truncation_with_a_bare_tokenizers_object_and_the_byte_tokenizer(bpe_tokenizer) -> None:
    bare = bpe_tokenizer.backend_tokenizer
    doc = text(4, 500)
    out, n, truncated = truncate_to_tokens(bare, doc, 50)
    assert truncated and n == len(bare.encode(out, add_special_tokens=False).ids) <= 50
    out, n, truncated = truncate_to_tokens(byte_tokenizer(), "héllo wörld " * 50, 101)
    assert truncated and len(out.encode("utf-8")) == n <= 101


def test_default_corpus_builds_offline_with_three_domains() -> None:
    corpus = Corpus.build(CorpusConfig())
    per = corpus.stats.per_domain
    assert set(per) == {"maths", "science", "code"} and min(per.values()) >= 200
    assert corpus.stats.exact_duplicates == 0
    ids = [d.id for d in corpus.documents]
    assert len(set(ids)) == len(ids)
    assert any("Breadth-first search" in d.text for d in corpus.documents)
    again = Corpus.build(CorpusConfig(sources=[CorpusSourceConfig(path="builtin:science", domain="science")]))
    assert [d.text for d in again.documents] == [d.text for d in corpus.documents if d.domain == "science"]


def test_load_tokenizer_from_a_local_folder_and_the_byte_default(bpe_tokenizer, tmp_path: Path) -> None:
    from spade_mega.tokenizer import TokenizerError, load_tokenizer

    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("def reset(self, seed):") == bpe_tokenizer.encode("def reset(self, seed):")
    byte = load_tokenizer(None)
    assert byte.encode("é", add_special_tokens=False) == [0xC3, 0xA9] and byte.decode([0xC3, 0xA9]) == "é"
    assert byte.convert_tokens_to_ids("<|im_end|>") == 258 and byte.eos_token == "<|im_end|>"
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_damaged_files_are_corpus_errors_naming_the_file(tmp_path: Path) -> None:
    # Bytes that are not UTF-8 in a JSONL line, a Parquet page whose compressed data is damaged, an Arrow stream cut
    # short: each names the file (and the line for JSONL), never a raw UnicodeDecodeError or OSError.
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(RECORDS[0]).encode() + b'\n{"body": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"latin1.jsonl:2: not UTF-8"):
        list(load_source(src(tmp_path / "latin1.jsonl")))
    records = [{"body": text(i, 200)} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet", row_group_size=50, compression="snappy")
    data = bytearray((tmp_path / "d.parquet").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 3000] = bytes((i * 37 + 11) % 256 for i in range(3000))
    (tmp_path / "d.parquet").write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=r"d.parquet: unreadable"):
        list(load_source(src(tmp_path / "d.parquet")))
    folder = save_to_disk(tmp_path / "hf", records, shards=1)
    shard = folder / "data-00000-of-00001.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CorpusError, match=r"data-00000-of-00001.arrow: unreadable"):
        list(load_source(src(folder)))


def test_a_source_that_yields_no_documents_is_named(tmp_path: Path) -> None:
    # A typo'd folder (or one holding only .json files) must not silently ground nothing while other sources work.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.json").write_text("{}")
    good = src(write_jsonl(tmp_path / "d.jsonl", [{"body": text(i)} for i in range(3)]))
    with pytest.raises(CorpusError, match=r"curriculum.corpus.sources\[1\] \(.*empty\): no documents"):
        Corpus.build(CorpusConfig(sources=[good, src(tmp_path / "empty", format="text")], min_chars=10))


def test_a_damaged_dataset_dict_or_a_folder_given_as_jsonl_is_named(tmp_path: Path) -> None:
    # A DatasetDict folder whose dataset_dict.json was cut short, and a folder of JSONL shards given as one jsonl
    # source: a CorpusError naming the file, not a raw JSONDecodeError / IsADirectoryError traceback.
    for content in ("{\"splits\": [\"tra", "[1]", "{}", "\xff"):
        folder = tmp_path / f"dd{len(content)}"
        folder.mkdir()
        (folder / "dataset_dict.json").write_text(content, encoding="latin-1")
        with pytest.raises(CorpusError, match=rf"{folder.name}/dataset_dict.json: unreadable dataset state"):
            list(load_source(src(folder)))
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "part-0.jsonl", RECORDS)
    with pytest.raises(CorpusError, match=r"shards: cannot read it as a jsonl file \(.*directory.*\)"):
        list(load_source(src(tmp_path / "shards", format="jsonl")))


def test_a_source_whose_documents_are_all_too_short_is_named(tmp_path: Path) -> None:
    # text_field pointing at a title: every record is read and dropped as shorter than min_chars. The source then
    # grounds nothing; the error must name it and say why, not leave a skill without its domain further on.
    good = src(write_jsonl(tmp_path / "d.jsonl", [{"body": text(i)} for i in range(3)]), domain="maths")
    titles = src(write_jsonl(tmp_path / "t.jsonl", [{"body": f"Title {i}"} for i in range(4)]), domain="science")
    with pytest.raises(CorpusError, match=r"curriculum.corpus.sources\[1\] \(.*t.jsonl\): all 4 documents are "
                                          r"shorter than min_chars \(50\)"):
        Corpus.build(CorpusConfig(sources=[good, titles], min_chars=50))
    assert len(Corpus.build(CorpusConfig(sources=[good, titles], min_chars=5))) == 7
