"""Chat templates rendered in the HTTP workers: sources, the sandbox, the helpers real templates call."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from handlers.chat_template import ChatTemplate, ChatTemplateError
from handlers.errors import HttpError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How are you?"}]


def test_the_made_models_template_renders_as_transformers_does(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    template = ChatTemplate.load(str(tiny_model))
    for add in (True, False):
        assert template.render(MESSAGES, add_generation_prompt=add) == \
            tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)


def test_tokenizer_config_template_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}"
                                            "{% endfor %}"}]}))
    template = ChatTemplate.load(str(tmp_path))
    assert template.render([{"role": "user", "content": "é\""}]) == '<s>"é\\""'


def test_the_override_is_a_file_or_an_inline_template(tiny_model, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert ChatTemplate.load(str(tiny_model), str(path)).render(MESSAGES[:2]) == "[system][user]"
    inline = ChatTemplate.load(str(tiny_model), "{{ messages | length }}{{ eos_token }}")
    assert inline.render(MESSAGES) == "4</s>"
    with pytest.raises(ChatTemplateError, match="neither a file nor a Jinja template"):
        ChatTemplate.load(str(tiny_model), "/no/such/template.jinja")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(str(tiny_model), "{% for %}")


def test_no_template_is_none(tiny_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink()
    assert ChatTemplate.load(str(model)) is None


def test_raise_exception_is_a_400_and_strftime_now_works(tiny_model):
    with pytest.raises(HttpError) as err:
        ChatTemplate.load(str(tiny_model)).render([{"role": "tool", "content": "x"}])
    assert err.value.code == 400 and "roles are system, user and assistant, not tool" in err.value.message
    assert len(ChatTemplate.load(str(tiny_model), "{{ strftime_now('%Y') }}").render([])) == 4


def test_the_sandbox_refuses_attribute_tricks(tiny_model):
    evil = ChatTemplate.load(str(tiny_model), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|access"):
        evil.render(MESSAGES)
    mutate = ChatTemplate.load(str(tiny_model), "{{ messages.append(1) }}")
    with pytest.raises(Exception, match="unsafe|immutable|access"):
        mutate.render(MESSAGES)
