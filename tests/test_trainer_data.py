"""Data pipeline: tokenizers, sources, caches, validation split, mixture phases, (seed, step) batches."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydoc_data.topics import topics

from trainer.config import DataConfig, MixturePhase, SourceConfig
from trainer.data import build_data, stdlib_code_files, stdlib_data_config
from trainer.tokenizer import ByteTokenizer, load_tokenizer

SEQ = 64
# Real prose nobody here wrote: the reference texts behind help('topic').
DOCS = [f"{name}\n{topics[name]}" for name in sorted(topics)]


def write_text_files(folder, docs) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(folder / "*.txt")


def one_source(source: SourceConfig, **kw) -> DataConfig:
    return DataConfig(sources=[source], phases=[MixturePhase(weights={source.name: 1.0})], **kw)


@pytest.fixture
def two_sources(tmp_path):
    """Two text sources with disjoint alphabets, so a row tells which source it came from."""
    lower = [" ".join(w for w in doc.lower().split() if w.isalpha() and w.isascii()) for doc in DOCS]
    a = [d.replace("z", "") for d in lower[:40]]  # 'a' has no 'z'
    b = [d.upper() for d in lower[40:]]  # 'b' has no lowercase letters
    return (
        SourceConfig(name="a", paths=[write_text_files(tmp_path / "a", a)]),
        SourceConfig(name="b", paths=[write_text_files(tmp_path / "b", b)]),
    )


def mixture(two_sources, phases, **kw) -> DataConfig:
    return DataConfig(sources=list(two_sources), phases=[MixturePhase(**p) for p in phases], **kw)


def test_byte_tokenizer_roundtrips_utf8():
    tok = load_tokenizer(None)
    ids = tok.encode("héllo")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert ids.tolist() == [104, 195, 169, 108, 108, 111]
    assert tok.decode(ids) == "héllo"


def test_batches_are_a_pure_function_of_seed_and_step(two_sources, tmp_path):
    cfg = mixture(two_sources, [{"weights": {"a": 0.5, "b": 0.5}}])
    first = build_data(cfg, seq_len=SEQ, num_steps=100, cache_dir=str(tmp_path / "c1"))
    second = build_data(cfg, seq_len=SEQ, num_steps=100, cache_dir=str(tmp_path / "c2"))  # rebuilt from scratch
    for step in (0, 1, 57, 99, 10_000):
        batch = first.train_batch(step, batch_size=8, seed=3)
        assert batch.shape == (8, SEQ + 1) and batch.dtype == np.int32
        np.testing.assert_array_equal(batch, second.train_batch(step, batch_size=8, seed=3))
    b0 = first.train_batch(0, batch_size=8, seed=3)
    assert not np.array_equal(b0, first.train_batch(1, batch_size=8, seed=3))
    assert not np.array_equal(b0, first.train_batch(0, batch_size=8, seed=4))
    # every row is a contiguous window of its source's training tokens
    rows_from = first.row_sources(0, batch_size=8, seed=3)
    for row, s in zip(b0, rows_from):
        train = first._sources[s].train.astype(np.uint8).tobytes()
        assert row.astype(np.uint8).tobytes() in train


def test_mixture_proportions_and_phase_switch(two_sources, tmp_path):
    cfg = mixture(
        two_sources,
        [{"weights": {"a": 0.7, "b": 0.3}}, {"start_fraction": 0.25, "weights": {"a": 0.1, "b": 0.9}}],
    )
    data = build_data(cfg, seq_len=SEQ, num_steps=4000, cache_dir=str(tmp_path / "c"))
    # phase 0 covers steps [0, 1000): 1000 steps x 32 rows; sampling sd of the share ~0.0026
    picks = np.concatenate([data.row_sources(s, batch_size=32, seed=0) for s in range(1000)])
    assert abs(np.mean(picks == 0) - 0.7) < 0.012
    picks = np.concatenate([data.row_sources(s, batch_size=32, seed=0) for s in range(1000, 2000)])
    assert abs(np.mean(picks == 0) - 0.1) < 0.01
    assert data.phase_index(999) == 0 and data.phase_index(1000) == 1
    assert data.phase_weights(1000) == {"a": 0.1, "b": 0.9}

    # the rows really come from the picked source: 'a' has lowercase text, 'b' none
    batch = data.train_batch(5, batch_size=32, seed=0)
    has_lower = ((batch >= ord("a")) & (batch <= ord("z"))).any(axis=1)
    np.testing.assert_array_equal(has_lower, data.row_sources(5, batch_size=32, seed=0) == 0)

    # a hard switch: all of 'a' before 40% of training, all of 'b' from step 4 of 10 on
    hard = mixture(two_sources, [{"weights": {"a": 1.0}}, {"start_fraction": 0.4, "weights": {"b": 1.0}}])
    data = build_data(hard, seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    sources = [set(data.row_sources(s, batch_size=64, seed=1).tolist()) for s in range(10)]
    assert sources == [{0}] * 4 + [{1}] * 6


def test_validation_split_is_whole_documents_disjoint_from_train(tmp_path):
    source = SourceConfig(name="topics", paths=[write_text_files(tmp_path / "t", DOCS)], validation_fraction=0.1)
    data = build_data(one_source(source), seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    tokens = data._sources[0]
    split_docs = lambda a: set(bytes(a.astype(np.uint8)).split(b"\0")) - {b""}  # noqa: E731
    train_docs, val_docs = split_docs(tokens.train), split_docs(tokens.validation)
    assert train_docs.isdisjoint(val_docs)
    assert train_docs | val_docs == {d.encode() for d in DOCS}
    counts = data.source_token_counts()["topics"]
    total = sum(len(d.encode()) + 1 for d in DOCS)
    assert counts["train"] + counts["validation"] == total
    assert 0.1 <= counts["validation"] / total <= 0.15

    # eval batches: deterministic windows of the held-out tokens only, spread evenly over the whole split
    evals = data.eval_batches("topics", batch_size=4, num_batches=3)
    again = data.eval_batches("topics", batch_size=4, num_batches=3)
    assert len(evals) == 3 and all(np.array_equal(x, y) for x, y in zip(evals, again))
    windows = (len(tokens.validation) - 1) // SEQ
    assert windows > 12, "the corpus must hold more held-out windows than asked for, or nothing is spread"
    starts = [i * windows // 12 * SEQ for i in range(12)]
    np.testing.assert_array_equal(np.concatenate(evals), [tokens.validation[s : s + SEQ + 1] for s in starts])
    assert starts[-1] >= (windows - windows // 12 - 1) * SEQ  # the last batch reaches the end of the split
    # asked for more windows than the split holds: every window in turn, then again from the first
    every = np.concatenate(data.eval_batches("topics", batch_size=4, num_batches=windows // 4 + 2))
    np.testing.assert_array_equal(every[:windows], [tokens.validation[w * SEQ : (w + 1) * SEQ + 1] for w in range(windows)])
    np.testing.assert_array_equal(every[windows], tokens.validation[: SEQ + 1])
    # windows="first" (TrainConfig.eval_windows, what every run read before): the split's first windows in a row
    first = np.concatenate(data.eval_batches("topics", batch_size=4, num_batches=3, windows="first"))
    np.testing.assert_array_equal(first, [tokens.validation[w * SEQ : (w + 1) * SEQ + 1] for w in range(12)])
    with pytest.raises(ValueError, match="'spread' or 'first'"):
        data.eval_batches("topics", batch_size=4, num_batches=1, windows="middle")
    with pytest.raises(KeyError, match="known sources"):
        data.eval_batches("nope", batch_size=4, num_batches=1)


def test_single_document_is_split_at_its_tail(tmp_path):
    text = "\n".join(DOCS[:10])
    (tmp_path / "one.txt").write_text(text)
    source = SourceConfig(name="one", paths=[str(tmp_path / "one.txt")], validation_fraction=0.05)
    data = build_data(one_source(source), seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    tokens = data._sources[0]
    stream = np.frombuffer(text.encode() + b"\0", dtype=np.uint8)
    assert tokens.meta["split"] == "tail"
    np.testing.assert_array_equal(np.concatenate([tokens.train, tokens.validation]), stream)
    assert len(tokens.validation) == int(np.ceil(0.05 * len(stream)))


def test_text_jsonl_parquet_and_memory_sources_yield_identical_tokens(tmp_path):
    docs = DOCS[:30]
    text = SourceConfig(name="text", paths=[write_text_files(tmp_path / "txt", docs)])
    lines = [json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)]
    (tmp_path / "docs.jsonl").write_text("".join(lines))
    jsonl = SourceConfig(name="jsonl", kind="jsonl", paths=[str(tmp_path / "docs.jsonl")], text_field="content")
    pq.write_table(pa.table({"body": docs[:12]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"body": docs[12:]}), tmp_path / "part-1.parquet")
    parquet = SourceConfig(name="parquet", kind="parquet", paths=[str(tmp_path / "part-*.parquet")], text_field="body")
    import fsspec

    fs = fsspec.filesystem("memory")
    for i, d in enumerate(docs):
        fs.pipe(f"/ladder-test-data/doc{i:03d}.txt", d.encode())
    memory = SourceConfig(name="memory", paths=["memory://ladder-test-data/"])
    cfg = DataConfig(sources=[text, jsonl, parquet, memory], phases=[MixturePhase(weights={"text": 1.0})])
    data = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    reference = data._sources[0]
    for tokens in data._sources[1:]:
        np.testing.assert_array_equal(tokens.train, reference.train)
        np.testing.assert_array_equal(tokens.validation, reference.validation)
    assert reference.meta["documents"] == 30


def test_cache_is_reused_and_invalidated_by_changed_input(tmp_path):
    pattern = write_text_files(tmp_path / "t", DOCS[:20])
    cfg = one_source(SourceConfig(name="t", paths=[pattern]))
    cache = str(tmp_path / "c")
    first = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache)
    meta = os.path.join(first.cache_paths["t"], "meta.json")
    stamp = os.stat(meta).st_mtime_ns
    second = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache)
    assert first.cache_status == {"t": "built"} and second.cache_status == {"t": "hit"}
    assert os.stat(meta).st_mtime_ns == stamp and isinstance(second._sources[0].train, np.memmap)
    np.testing.assert_array_equal(
        first.train_batch(3, batch_size=4, seed=0), second.train_batch(3, batch_size=4, seed=0)
    )

    (tmp_path / "t" / "doc000.txt").write_text("changed text " * 50)
    third = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache)
    assert third.cache_status == {"t": "built"} and third.cache_paths["t"] != first.cache_paths["t"]


@pytest.mark.parametrize("damage", ["truncate", "flip_bytes", "bad_meta", "no_meta"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, damage):
    cfg = one_source(SourceConfig(name="t", paths=[write_text_files(tmp_path / "t", DOCS[:20])]))
    cache = str(tmp_path / "c")
    before = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache)
    expected = before.train_batch(0, batch_size=4, seed=0)
    directory = before.cache_paths["t"]
    del before
    train_file, meta_file = os.path.join(directory, "train.npy"), os.path.join(directory, "meta.json")
    if damage == "truncate":
        with open(train_file, "r+b") as f:
            f.truncate(os.path.getsize(train_file) // 2)
    elif damage == "flip_bytes":
        with open(train_file, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            f.write(b"\xff" * 100)
    elif damage == "bad_meta":
        with open(meta_file, "w") as f:
            f.write('{"format": 1, "key": ')
    else:
        os.remove(meta_file)
    # a killed build leaves only a temporary sibling directory, which is ignored
    os.makedirs(directory + ".tmp-999-deadbeef")
    with pytest.warns(UserWarning, match="unusable"):
        after = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache)
    assert after.cache_status == {"t": "rebuilt"}
    assert not os.path.exists(directory + ".tmp-999-deadbeef")
    np.testing.assert_array_equal(after.train_batch(0, batch_size=4, seed=0), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=cache).cache_status == {"t": "hit"}


def test_process_slices_concatenate_to_the_global_batch(two_sources, tmp_path):
    cfg = mixture(two_sources, [{"weights": {"a": 0.5, "b": 0.5}}])
    data = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    full = data.train_batch(7, batch_size=16, seed=5)
    parts = [data.train_batch(7, batch_size=16, seed=5, process_index=i, process_count=4) for i in range(4)]
    assert all(p.shape == (4, SEQ + 1) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), full)
    full_eval = data.eval_batches("a", batch_size=8, num_batches=2)
    parts = [data.eval_batches("a", batch_size=8, num_batches=2, process_index=i, process_count=2) for i in range(2)]
    for b in range(2):
        np.testing.assert_array_equal(np.concatenate([p[b] for p in parts]), full_eval[b])
    with pytest.raises(ValueError, match="not divisible by process_count=3"):
        data.train_batch(0, batch_size=16, seed=0, process_index=0, process_count=3)


def test_max_tokens_per_source_caps_what_is_read(tmp_path):
    source = SourceConfig(name="t", paths=[write_text_files(tmp_path / "t", DOCS)])
    cfg = one_source(source, max_tokens_per_source=20_000)
    data = build_data(cfg, seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    counts = data.source_token_counts()["t"]
    assert counts["train"] + counts["validation"] == 20_000
    assert data._sources[0].meta["documents"] < len(DOCS)


def test_hugging_face_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(DOCS[:20], trainer)
    path = str(tmp_path / "tokenizer.json")
    bpe.save(path)

    tok = load_tokenizer(path)
    assert tok.vocab_size == bpe.get_vocab_size() and tok.eos_id == 0
    text = "The quick brown fox — naïve café."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(DOCS[0])) < 0.7 * len(DOCS[0].encode())  # a trained BPE compresses text it saw

    source = SourceConfig(name="t", paths=[write_text_files(tmp_path / "t", DOCS[:30])])
    data = build_data(one_source(source, tokenizer=path), seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    batch = data.train_batch(0, batch_size=8, seed=0)
    assert data.vocab_size == tok.vocab_size and batch.max() < tok.vocab_size and batch.max() > 255
    byte_data = build_data(one_source(source), seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"))
    assert byte_data.cache_paths["t"] != data.cache_paths["t"]  # the tokenizer is part of the cache key
    data.check_vocab(512)
    with pytest.raises(ValueError, match=f"model.vocab_size=256; set model.vocab_size to at least {tok.vocab_size}"):
        data.check_vocab(256)
    with pytest.raises(ValueError, match="vocab_size"):
        build_data(
            one_source(source, tokenizer=path), seq_len=SEQ, num_steps=10, cache_dir=str(tmp_path / "c"),
            model_vocab_size=256,
        )


def test_stdlib_corpora_are_real_offline_text(tmp_path):
    cfg = stdlib_data_config(0.5, max_tokens_per_source=300_000)
    data = build_data(cfg, seq_len=256, num_steps=10, cache_dir=str(tmp_path / "c"))
    assert data.source_names == ["code", "docs"]
    code, docs = (np.concatenate([s.train, s.validation]).astype(np.uint8).tobytes() for s in data._sources)
    assert b"import " in code and code.count(b"def ") > 5 * docs.count(b"def ")  # code vs prose about code
    assert b'The "assert" statement' in docs  # help('assert'), shipped in pydoc_data
    assert len(stdlib_code_files()) > 100 and not any("/test/" in p.as_posix() for p in stdlib_code_files())
    assert data.source_token_counts()["code"]["train"] + data.source_token_counts()["code"]["validation"] == 300_000


def test_clear_errors(tmp_path):
    cache = str(tmp_path / "c")
    build = lambda cfg, seq_len=SEQ: build_data(cfg, seq_len=seq_len, num_steps=10, cache_dir=cache)  # noqa: E731

    with pytest.raises(FileNotFoundError, match=r"data.sources\[0\].paths\[0\]=.*matches no files"):
        build(one_source(SourceConfig(name="t", paths=[str(tmp_path / "missing" / "*.txt")])))

    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x" * 1000}) + "\n")
    with pytest.raises(ValueError, match=r"has no key 'text' .*set data.sources\[0\].text_field"):
        build(one_source(SourceConfig(name="j", kind="jsonl", paths=[str(tmp_path / "d.jsonl")])))

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"line 2 of .*bad.jsonl is not valid JSON"):
        build(one_source(SourceConfig(name="j", kind="jsonl", paths=[str(tmp_path / "bad.jsonl")])))

    pq.write_table(pa.table({"body": ["x" * 1000]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body'\]\)"):
        build(one_source(SourceConfig(name="p", kind="parquet", paths=[str(tmp_path / "d.parquet")])))

    small = one_source(SourceConfig(name="s", paths=[write_text_files(tmp_path / "s", DOCS[:20])]))
    counts = build(small).source_token_counts()["s"]
    val = counts["validation"]
    too_few = rf"has {val} validation tokens, fewer than one sequence of seq_len \+ 1 = {val + 1}"
    with pytest.raises(ValueError, match=too_few):
        build(small, seq_len=val)
    with pytest.raises(ValueError, match=rf"has {counts['train']} train tokens, fewer than one sequence"):
        build(small, seq_len=counts["train"])

    with pytest.raises(ValueError, match="paths must be empty for kind='stdlib_code'"):
        build(one_source(SourceConfig(name="c", kind="stdlib_code", paths=["x"])))
    with pytest.raises(FileNotFoundError, match="data.tokenizer="):
        build(one_source(SourceConfig(name="s", paths=["x"]), tokenizer=str(tmp_path / "nope.json")))
