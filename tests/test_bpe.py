"""bpe.py: the from-scratch policies' tokenizer (Qwen2's pipeline, BPE merges learned from a task's text)."""
import json

import arith
import bpe


def corpus(n=200):
    return [f"user\n{it['question']}\nassistant\n{it['answer']}" for it in arith.load("train", n, seed=0)]


def test_qwen2_pipeline_digits_specials_and_template():
    """Every digit a token of its own, whatever the merges; any text round-trips (bytes); the specials hold
    the first ids, eos and pad as Qwen2.5's; the chat template is ChatML without a system prompt."""
    tok = bpe.build_tokenizer(corpus(), 300)
    assert len(tok) <= 300
    pieces = [tok.decode([i]) for i in tok("x = 4071 + 23", add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["4", "0", "7", "1", "2", "3"]
    assert tok.convert_tokens_to_ids(bpe.SPECIAL) == [0, 1, 2]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "Crème brûlée costs €3\t!"  # never seen: byte-level
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"


def test_saved_files_load_as_a_qwen2_tokenizer(tmp_path):
    """save_tokenizer writes what a Qwen2 folder holds, the template inside tokenizer_config.json; transformers
    loads the folder to the same ids, specials and template."""
    from transformers import AutoTokenizer

    tok = bpe.build_tokenizer(corpus(), 320)
    bpe.save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["chat_template"] == bpe.CHAT_TEMPLATE
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = corpus(3)[2] + "<|im_end|>"
    assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert (back.eos_token_id, back.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert back.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=False, add_generation_prompt=True) \
        == tok.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=False, add_generation_prompt=True)
