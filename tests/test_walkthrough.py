"""The seed's walkthrough, reproduced character for character."""

import io
import runpy
import sys
from pathlib import Path

import paged_jax as pj
from paged_jax.walkthrough import run_walkthrough

# Copied verbatim from the seed write-up ("Visualizing the layout").
SEED_LINES = """\
# Request A arrives: 40 tokens prompt (needs 3 blocks: ceil(40/16))
req_a = RequestState(request_id="A", prompt_len=40, allocator=allocator)
# Block table: [0, 1, 2]       Free: 17 blocks
# Request B arrives: 24 tokens prompt (needs 2 blocks)
req_b = RequestState(request_id="B", prompt_len=24, allocator=allocator)
# Block table: [3, 4]          Free: 15 blocks
# Request C arrives: 50 tokens prompt (needs 4 blocks)
req_c = RequestState(request_id="C", prompt_len=50, allocator=allocator)
# Block table: [5, 6, 7, 8]    Free: 11 blocks
# GPU memory layout after initial allocation:
# [A][A][A][B][B][C][C][C][C][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ]
#  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
# A generates 10 more tokens (now 50 total, needs 4th block)
for _ in range(10):
    req_a.append_token()
# A's block table: [0, 1, 2, 9]   (block 9 allocated for overflow)
# B finishes. Release its blocks.
req_b.release()
# Blocks 3 and 4 return to free list
# GPU memory layout after B finishes:
# [A][A][A][ ][ ][C][C][C][C][A][ ][ ][ ][ ][ ][ ][ ][ ][ ][ ]
#  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
# Note: A's blocks are NOT contiguous! Blocks 0,1,2 and 9.""".splitlines()


def assert_in_order(lines, wanted):
    pos = 0
    for want in wanted:
        assert want in lines[pos:], f"missing, or out of order: {want!r}"
        pos = lines.index(want, pos) + 1


def test_walkthrough_reproduces_seed_pictures():
    out = io.StringIO()
    allocator = run_walkthrough(out)
    lines = out.getvalue().splitlines()
    assert_in_order(lines, SEED_LINES)
    pj.assert_invariants(allocator.state)


def test_walkthrough_prefix_sharing_accounting():
    out = io.StringIO()
    run_walkthrough(out)
    lines = out.getvalue().splitlines()
    assert_in_order(lines, [
        "# sys_prompt_blocks = [10, 11]   ref counts [1, 1]: the prompt's own reference",
        "# D's table: [10, 11, 12]   shared ref counts [2, 2]",
        "# E's table: [10, 11, 13]   shared ref counts [3, 3]",
        "# [A][A][A][ ][ ][C][C][C][C][A][*][*][D][E][ ][ ][ ][ ][ ][ ]",
        "#   in a fresh 4-block pool: after E joins, ref counts = [2, 2] (should be [3, 3])",
        "# Ref counts [1, 1]: E still owns its prompt blocks",
        "# [A][A][A][ ][ ][C][C][C][C][A][E][E][ ][E][ ][ ][ ][ ][ ][ ]",
    ])


def test_seed_file_pictures_if_present():
    """Against the seed write-up itself when shared/ sits beside the checkout."""
    seed = Path(__file__).resolve().parents[2] / "shared/seeds/000_cd6501c9c1f1ff6f.txt"
    if not seed.exists():  # the literal copy above is the same text
        return
    text = seed.read_text()
    pictures = [ln for ln in text.splitlines() if ln.startswith(("# [", "#  0"))]
    assert len(pictures) == 4
    out = io.StringIO()
    run_walkthrough(out)
    assert_in_order(out.getvalue().splitlines(), pictures)


def test_example_script_and_cli(capsys, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "argv", ["seed_walkthrough.py"])
    try:
        runpy.run_path(str(root / "examples/seed_walkthrough.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code == 0
    script_out = capsys.readouterr().out
    from paged_jax.cli import main

    assert main(["demo"]) == 0
    assert capsys.readouterr().out == script_out
    assert_in_order(script_out.splitlines(), SEED_LINES)


def test_render_layout_wide_pools_stay_aligned():
    cfg = pj.CacheConfig(num_blocks=120, block_size=4, max_seqs=2, max_blocks_per_seq=120)
    state = pj.init_state(cfg)
    state, _ = pj.admit(state, [0, 1], [400, 4])
    cells, ruler = pj.render_layout(state, labels={0: "A", 1: "B"}).splitlines()
    assert len(cells) == 120 * 4 and cells.startswith("[A ][A ]")
    assert cells[100 * 4: 101 * 4] == "[B ]" and ruler.endswith("118 119")
    assert ruler[: 8] == "  0   1 "
