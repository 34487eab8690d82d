"""model_card.py: the README.md of a tiny.py checkpoint, and the measured block --report-only swaps."""
import argparse
import json
from pathlib import Path

import model_card
import tiny

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny"

OLD = """# a card
text above, edited by hand

## Held-out accuracy (first 3 problems; 2 samples each)
| weights | greedy |
| --- | --- |
| bf16 | 0.100 |

text below
| a table that is not the measured one |
"""


def test_table_block_and_replace_table():
    """The measured block is the heading line and the table right under it (one blank line allowed between);
    replace_table swaps that block alone, and takes the new text whole when the old has no block."""
    assert model_card.table_block(OLD) == (3, 7)
    new = OLD.replace("# a card\ntext above, edited by hand", "# regenerated").replace("first 3", "first 9") \
             .replace("| bf16 | 0.100 |", "| bf16 | 0.900 |\n| nvfp4 | 0.800 |")
    got = model_card.replace_table(OLD, new)
    assert got.split("\n")[:3] == OLD.split("\n")[:3]  # the hand edits stay
    assert "first 9 problems" in got and "| nvfp4 | 0.800 |" in got and "0.100" not in got
    assert got.endswith("text below\n| a table that is not the measured one |\n")
    spaced = "x\n" + model_card.TABLE_HEADING + "\n\n| a |\n| 1 |\nafter"
    assert model_card.table_block(spaced) == (1, 5)
    assert model_card.table_block("no table here") is None
    assert model_card.replace_table("no table here", new) == new


def test_card_from_the_bundled_record():
    """The bundled checkpoint's training.json and config.json give a card with its numbers: the command, the
    architecture as saved, one final row per weight format and one probe row per history entry."""
    from transformers import AutoConfig

    meta = json.loads((TINY / "training.json").read_text())
    args = argparse.Namespace(**{**tiny.PRESETS["arith"], "task": "arith", **meta["args"]})
    text = model_card.readme(tiny.SYNTHETIC["arith"], args, meta, AutoConfig.from_pretrained(TINY), 500, 8)
    assert text.startswith("# tiny: the bundled policy\n") and f"    {meta['command']}\n" in text
    assert "hidden 128, 4 layers, 4 query heads and\n  2 key/value heads of dim 32" in text
    start, end = model_card.table_block(text)
    block = text.split("\n")[start:end]
    assert "first 500 problems; 8 samples each" in block[0] and len(block) == 5  # heading, header, rule, 2 rows
    assert f"| {meta['final']['nvfp4']['greedy']:.3f} |" in block[-1]
    assert sum(line.startswith(f"| {h['step']} |") for h in meta["history"] for line in text.split("\n")) \
        == len(meta["history"])
