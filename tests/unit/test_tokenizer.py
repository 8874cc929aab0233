"""Tokenizer vs transformers' GGUF tokenizer, chat template, and TextStreamer invariants."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from specserve.tokenizer import Tokenizer, TextStreamer

TEXTS = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "Numbers: 12345, 3.14159, -42 and 1e10.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "emoji 😀🎉👩‍👩‍👧 and 中文字符 and ñandú, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "tabs\tand\r\nnewlines\n\n\n",
    "It's we'll they've I'M you'D",
    "",
    " ",
    "\u00a0non-breaking\u2003spaces",
    "{\"json\": [1, 2, {\"k\": null}]}",
    "<html><body class='x'>&amp;</body></html>",
    "x" * 300,
]
# Whitespace runs before digits: llama.cpp (and SmolLM's own tokenizer.json) split every digit off
# first, transformers' GGUF conversion does not, so there the two differ; we follow llama.cpp.
DIGIT_SPLIT_CASES = {
    "a  12": ["a", "ĠĠ", "1", "2"],
    "x \t7": ["x", "Ġ", "ĉ", "7"],
    "½ and  ¾": ["Â½", "Ġand", "ĠĠ", "Â¾"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
    [{"role": "user", "content": "First"}, {"role": "assistant", "content": "Second\n\nwith lines"}],
]


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path) -> Tokenizer:
    return Tokenizer.load(default_gguf_path)


@pytest.fixture(scope="module")
def reference(default_gguf_path):
    """transformers' tokenizer built from the same GGUF."""
    from transformers import AutoTokenizer

    path = Path(default_gguf_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ---- encode / decode ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", sorted(DIGIT_SPLIT_CASES))
def test_digits_are_split_like_llama_cpp(tokenizer, text):
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode(text)]
    assert pieces == DIGIT_SPLIT_CASES[text]


def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == (2, 0)  # <|im_end|> ends a chat turn, <|endoftext|> a document
    assert tokenizer.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # no BOS for SmolLM2
    assert tokenizer.decode([1, 30, 2, 0]) == "." and tokenizer.decode([1, 30], False) == "<|im_start|>."
    assert tokenizer.id_to_piece(2) == "<|im_end|>" and tokenizer.id_to_piece(216) == "Ġ"
    assert tokenizer.special_token_ids["<|endoftext|>"] == 0


# ---- chat template -------------------------------------------------------------------------------

@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_content_parts(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(plain)
    with pytest.raises(ValueError, match="image_url"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_raise_exception(tokenizer):
    from jinja2.exceptions import TemplateError

    tokenizer = Tokenizer(tokenizer.backend, bos_token="<s>", eos_token="</s>", eos_token_ids=(2,),
                          chat_template="{{ bos_token }}{% if messages|length > 1 %}"
                                        "{{ raise_exception('only one message') }}{% endif %}{{ eos_token }}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<s></s>"
    with pytest.raises(TemplateError, match="only one message"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}] * 2)


def test_hf_dir_tokenizer_matches_gguf(tokenizer, hf_export_dir):
    exported = Tokenizer.load(hf_export_dir)
    assert exported.chat_template == tokenizer.chat_template
    assert exported.eos_token_ids == tokenizer.eos_token_ids and exported.bos_token_id == tokenizer.bos_token_id
    assert exported.vocab_size == tokenizer.vocab_size
    for text in TEXTS + sorted(DIGIT_SPLIT_CASES):
        assert exported.encode(text) == tokenizer.encode(text)


def test_load_error_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.load(tmp_path / "nowhere")


# ---- TextStreamer ----------------------------------------------------------------------------------

def _cut_at_first_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """Brute force: the stop string that completes first (longest on a tie) and the text before it."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if s and text[:end].endswith(s)]
        if done:
            matched = max(done, key=len)
            return text[:end - len(matched)], matched
    return text, None


def _stream(tokenizer, ids, stop, rng, check_holdback=True):
    """Feed ``ids`` in random chunks; check each delta; return (all text, matched stop)."""
    streamer = TextStreamer(tokenizer, stop=stop)
    final_text = tokenizer.decode(ids)
    pos, matched = 0, None
    while pos < len(ids) and matched is None:
        size = rng.choice([1, 1, 1, 2, 3, 7])
        delta, matched = streamer.feed(ids[pos:pos + size])
        pos += size
        assert final_text.startswith(streamer.text)  # deltas are final: no partial character emitted
        if check_holdback and matched is None:
            _assert_nothing_emitted_could_start_a_stop(streamer.text, tokenizer.decode(ids[:pos]), stop)
    if matched is None:
        streamer.flush()
    return streamer.text, streamer.matched_stop


def _assert_nothing_emitted_could_start_a_stop(emitted: str, decoded: str, stop: list[str]) -> None:
    assert decoded.startswith(emitted)
    for start in range(len(emitted)):
        rest = decoded[start:]
        assert not any(s.startswith(rest) for s in stop if len(rest) < len(s)), (emitted, rest)


def _byte_fragment_ids(tokenizer) -> list[int]:
    """Tokens that are one byte of a multi-byte UTF-8 character (they decode to U+FFFD alone)."""
    return [i for i in range(1000) if tokenizer.decode([i]) == "\ufffd"]


def test_streamer_random_sequences_match_decode(tokenizer):
    rng = random.Random(1234)
    fragments = _byte_fragment_ids(tokenizer)
    natural = tokenizer.encode(" ".join(TEXTS))
    for trial in range(150):
        ids = [rng.choice([rng.randrange(tokenizer.vocab_size), rng.choice(fragments), rng.randrange(17),
                           rng.choice(natural)]) for _ in range(rng.randrange(1, 40))]
        full = tokenizer.decode(ids)
        stop = [full[i:i + rng.randint(1, 4)] for i in rng.choices(range(len(full) + 1), k=2)] if trial % 3 else []
        stop += ["\n\n", "zz"] if trial % 2 else []
        text, matched = _stream(tokenizer, ids, stop, rng)
        assert (text, matched) == _cut_at_first_stop(full, stop), (ids, stop)


def test_streamer_multibyte_characters_are_held_back(tokenizer):
    ids = tokenizer.encode("smile 😀 and 中文 done")
    streamer = TextStreamer(tokenizer, stop=[])
    deltas = [streamer.feed([token_id])[0] for token_id in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + streamer.flush() == "smile 😀 and 中文 done"


def test_streamer_stops_before_stop_string(tokenizer):
    ids = tokenizer.encode("The answer is 4.\nUser: next question")
    streamer = TextStreamer(tokenizer, stop=["\nUser:", "never"])
    deltas, matched = [], None
    for token_id in ids:
        delta, matched = streamer.feed([token_id])
        deltas.append(delta)
        if matched:
            break
    assert matched == "\nUser:" and "".join(deltas) == "The answer is 4." == streamer.text
    assert streamer.feed(tokenizer.encode(" more")) == ("", None) and streamer.flush() == ""


def test_streamer_flush_releases_partial_stop(tokenizer):
    streamer = TextStreamer(tokenizer, stop=["<END>"])
    delta, matched = streamer.feed(tokenizer.encode("done <EN"))
    assert (delta, matched) == ("done ", None)
    assert streamer.flush() == "<EN" and streamer.text == "done <EN"


def test_streamer_decodes_a_small_window(tokenizer):
    """Each feed decodes O(new tokens), not the whole output."""
    window_sizes = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            window_sizes.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 3)
    streamer = TextStreamer(CountingTokenizer(), stop=["###"])
    for token_id in ids:
        streamer.feed([token_id])
    assert len(ids) > 300 and max(window_sizes) <= 8
    streamer.flush()
    assert streamer.text == tokenizer.decode(ids)
