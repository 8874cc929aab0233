"""The front's tokenizer, loaded while the model process loads the model: used only where it is
the tokenizer the model process names, and a load that fails is left to the load after Ready."""
from __future__ import annotations

from specserve.config import ServerArgs
from specserve.server.engine_client import TokenizerPrefetch
from specserve.tokenizer import Tokenizer


def test_the_prefetched_tokenizer_is_the_one_the_model_process_names(default_gguf_path):
    prefetch = TokenizerPrefetch.start_for(ServerArgs(model_path=default_gguf_path))
    assert prefetch is not None
    tokenizer = prefetch.tokenizer_for(default_gguf_path)
    text = "Speculative decoding, verified: 17 x 3 = 51."
    assert tokenizer.encode(text) == Tokenizer.load(default_gguf_path).encode(text)
    assert prefetch.tokenizer_for(default_gguf_path + ".other") is None


def test_an_explicit_tokenizer_path_is_what_is_prefetched(default_gguf_path, tmp_path):
    prefetch = TokenizerPrefetch.start_for(ServerArgs(model_path=str(tmp_path), tokenizer_path=default_gguf_path))
    assert prefetch.path == default_gguf_path


def test_nothing_is_prefetched_for_a_path_the_front_cannot_see(tmp_path):
    assert TokenizerPrefetch.start_for(ServerArgs(model_path=str(tmp_path / "Org/model-on-the-hub"))) is None


def test_a_failed_prefetch_gives_none_for_the_load_after_ready_to_report(tmp_path):
    prefetch = TokenizerPrefetch.start_for(ServerArgs(model_path=str(tmp_path)))    # no tokenizer files there
    assert prefetch is not None and prefetch.tokenizer_for(str(tmp_path)) is None
