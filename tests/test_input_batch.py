"""InputBatch keeps per-sequence rows across steps: pages appended, rows reused after release."""

import numpy as np
import pytest

from jaxllm.engine.input_batch import (
    ALLOWED_IDS,
    FILTERING,
    HAS_PARAMS,
    LOGPROBS,
    PADDING_ROW,
    PENALTIES,
    PROMPT_LOGPROBS,
    InputBatch,
    key_seed,
)
from jaxllm.engine.sequence import Sequence
from jaxllm.sampling_params import SamplingParams


def seq(seq_id, table, **sp):
    s = Sequence(seq_id, [1, 2, 3], sampling_params=SamplingParams(**sp) if sp else None)
    s.block_table, s.rng_seed = list(table), 42
    return s


def test_rows_track_tables_and_settings():
    b = InputBatch(max_rows=3, max_pages=4, pad_page=0)
    a, c = seq("a", [5], temperature=0.5, top_k=3), seq("c", [7, 8])
    rows = b.rows([a, c])
    assert b.tables[rows[0], :1].tolist() == [5] and b.tables[rows[1], :2].tolist() == [7, 8]
    assert b.sampling[rows[0]].tolist() == pytest.approx([0.5, 1.0, 3, 0.0, 0.0, 0.0, 1.0])
    assert b.sampling[rows[1]].tolist() == list(PADDING_ROW) and b.seeds[rows[0]] == key_seed(42)
    a.block_table.append(9)  # a grew a page: only that page is written, the row stays
    assert b.rows([a]).tolist() == [rows[0]] and b.tables[rows[0], :2].tolist() == [5, 9]
    b.release(["a", "zzz"])  # unknown ids are ignored
    d = seq("d", [3, 1, 4])
    row_d = b.rows([d])[0]
    assert row_d == rows[0] and b.tables[row_d, :3].tolist() == [3, 1, 4]
    d.block_table = [6]  # a table that shrank (re-admission) is rewritten
    b.rows([d])
    assert b.tables[row_d, 0] == 6


def test_no_free_row_is_a_clear_error():
    b = InputBatch(max_rows=1, max_pages=2)
    b.rows([seq("a", [1])])
    with pytest.raises(RuntimeError, match="no free row"):
        b.rows([seq("b", [2])])
    assert np.all(b.tables[0, :1] == [1])


def test_rows_record_sampler_features():
    b = InputBatch(max_rows=4, max_pages=2)
    plain, filt, pen, rest = (
        seq("p", [1], temperature=0.0),
        seq("f", [2], top_p=0.5),
        seq("r", [3], repetition_penalty=1.1),
        seq("x", [4], allowed_token_ids=[5], logprobs=1, prompt_logprobs=0),
    )
    rows = b.rows([plain, filt, pen, rest])
    assert b.features[rows].tolist() == [
        HAS_PARAMS,
        HAS_PARAMS | FILTERING,
        HAS_PARAMS | PENALTIES,
        HAS_PARAMS | ALLOWED_IDS | LOGPROBS | PROMPT_LOGPROBS,
    ]
    b.release(["p"])
    assert b.features[b.rows([seq("none", [6])])[0]] == 0  # no sampling params: a padding row


def test_rows_follow_growth_of_many_sequences():
    b = InputBatch(max_rows=8, max_pages=10)
    seqs = [seq(str(i), [10 * i + 1]) for i in range(6)]
    seqs[4].block_table = [41, 42, 43]
    rows = b.rows(seqs)
    for step in range(4):  # some grow by one page, one by two; one shrinks (rewritten) and grows in turn
        seqs[step].block_table.append(10 * step + 2 + step)
        seqs[5].block_table.extend([90 + step, 95 + step])
        if step % 2:
            seqs[4].block_table.append(80 + step)
        else:
            seqs[4].block_table = [70 + step]
        assert b.rows(seqs).tolist() == rows.tolist()
        for s, r in zip(seqs, rows):
            assert b.tables[r, : len(s.block_table)].tolist() == s.block_table


def test_key_seed_uses_all_64_bits():
    """Request seeds that differ only above bit 31 (or are negative) get different 32-bit key seeds."""
    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, 2**63 - 1, -1, -2, 5, 2**40 + 5]
    keys = [key_seed(s) for s in seeds]
    assert len(set(keys)) == len(seeds) and all(0 <= k < 2**32 for k in keys)
    assert key_seed(-1) == key_seed(2**64 - 1)  # the same 64-bit value


def test_a_trimmed_table_that_grows_back_to_its_length_is_rewritten():
    """Speculative decoding frees a rejected token's page and the next step takes another one: the table has its
    old length again with a new last page, which truncate() (the scheduler's SchedulerOutput.trimmed) exposes."""
    batch = InputBatch(4, 8)
    seq = Sequence("a", [1, 2, 3])
    seq.block_table = [5, 6, 7]
    row = int(batch.rows([seq])[0])
    seq.block_table = [5, 6, 9]  # page 7 freed by the rollback, page 9 taken by the next step
    assert batch.tables[batch.rows([seq])[0], :3].tolist() == [5, 6, 7]  # stale without truncate
    batch.truncate({"a": 2})
    assert int(batch.rows([seq])[0]) == row and batch.tables[row, :3].tolist() == [5, 6, 9]
