"""bpe.py: the tokenizer of a policy trained from scratch (tiny.py): a byte-level BPE learned from the
task's own text, in Qwen2's exact pipeline, with Qwen2.5's chat template.

The pipeline is Qwen2's: NFC, its pre-tokenizer split (QWEN2_SPLIT, which puts every digit in a token of
its own, so arithmetic is done digit by digit), then bytes, so any text still encodes. Only the merges
are learned, from the text the policy will read and write; the vocabulary is what that text supports up
to the size asked. Specials (SPECIAL): `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos). The
chat template is ChatML as in Qwen2.5 without Qwen's default system prompt (it would double the prompt of
a model that cannot use it): `<|im_start|>user\\n{message}<|im_end|>\\n<|im_start|>assistant\\n`.

Why Qwen2's exact pipeline: transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer,
which rebuilds the pipeline from the vocab and merges, so a different pre-tokenizer would be silently
replaced. `save_tokenizer` writes the files a Qwen2 folder has, the template inside tokenizer_config.json.
"""
import json

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (its tokenizer.json): words with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(texts, vocab_size):
    """A byte-level BPE of at most `vocab_size` tokens (specials included) trained on `texts`, in Qwen2's
    own tokenizer pipeline (NFC, its split regex with one digit a token, byte-level), wrapped as an HF
    fast tokenizer with the chat template, eos `<|im_end|>` and pad `<|endoftext|>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def save_tokenizer(tokenizer, out):
    """tokenizer.json from the library's own text, tokenizer_config.json written by hand so that the chat
    template sits inside it (transformers' save_pretrained would move it to a separate .jinja file).
    Written by Python's open, so a full disk is an OSError that hub.writing reports."""
    (out / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str(pretty=True))
    added = {str(tokenizer.convert_tokens_to_ids(t)): {"content": t, "special": True, "lstrip": False,
                                                      "rstrip": False, "normalized": False, "single_word": False}
             for t in SPECIAL}
    config = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
              "model_max_length": 512, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
