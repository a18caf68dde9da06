import pyarrow as pa
import pyarrow.parquet as pq

from bapo.train.config import DataSection
from bapo.train.data import PromptSampler, load_examples, tokenize_prompts


def test_parquet_rows_load(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    assert load_examples(DataSection(path=str(path))) == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]


def test_prompts_tokenized_once_long_ones_dropped_chat_template_applied(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": "1+1="}, {"prompt": "1234567890+1="}]
    kept, ids, dropped = tokenize_prompts(rows, tok, DataSection(max_prompt_tokens=8))
    assert kept == rows[:1] and dropped == 1 and tok.decode(ids[0]) == "1+1="
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"
    _, ids, _ = tokenize_prompts(rows[:1], tok, DataSection(chat_template=True, system_prompt="be brief"))
    assert tok.decode(ids[0]) == "s:be brief\nu:1+1=\na:"


def test_prompt_sampler_covers_each_epoch_and_resumes():
    sampler = PromptSampler(size=5, seed=3)
    first = sampler.take(5)
    assert sorted(first) == list(range(5))
    state = sampler.state_dict()
    ahead = sampler.take(7)
    again = PromptSampler(size=5, seed=3)
    again.load_state_dict(state)
    assert again.take(7) == ahead and sorted(ahead[:5]) == list(range(5)) and ahead[:5] != first


def test_digit_token_ids_are_the_tokens_that_hold_a_digit():
    from bapo.train.data import digit_token_ids
    from bapo.train.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = digit_token_ids(tokenizer)
    assert sorted(tokenizer.convert_ids_to_tokens(ids)) == list("0123456789")
