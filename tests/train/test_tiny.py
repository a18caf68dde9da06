from bapo.train.tiny import ModelConfig, build_model, build_tokenizer


def test_round_trip_is_exact():
    tok = build_tokenizer()
    for text in ["7,12,5>17:12-7=5\n12+5=17", "3-9=-6\n\nanswer:-6", "0"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per char
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_unknown_chars_become_unk_and_padding_is_left():
    tok = build_tokenizer()
    assert tok("1?2")["input_ids"][2] == tok.unk_token_id
    batch = tok(["1+2=", "10+20="], padding=True)["input_ids"]
    assert batch[0][:2] == [tok.pad_token_id] * 2 and batch[1][0] == tok.bos_token_id


def test_saved_tokenizer_and_model_load_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, layers=1, heads=2, intermediate_size=64), tok)
    tok.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "7-5+8=7-5=2\n2+8=10\nanswer:10"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.decode(again(text)["input_ids"], skip_special_tokens=True) == text
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.vocab_size == len(tok) and loaded.config.eos_token_id == tok.eos_token_id
