use minijinja::{Environment, Error, ErrorKind, context};

use crate::records::Message;

/// ChatML, used when the tokenizer brings no `chat_template`.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A Jinja chat template as transformers renders it (`trim_blocks`,
/// `lstrip_blocks`, Python string methods, `raise_exception`).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; the special tokens are what templates see as
    /// `bos_token` and `eos_token`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|err| format!("the chat template does not compile: {err}"))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The conversation as text; with `add_generation_prompt` the template
    /// appends the header of the next assistant turn.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let messages: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role, content => m.content })
            .collect();
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|err| err.to_string())?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|err| format!("the chat template failed: {err}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Vec<Message> {
        vec![
            Message {
                role: "user".into(),
                content: "2+2?".into(),
            },
            Message {
                role: "assistant".into(),
                content: "4".into(),
            },
        ]
    }

    #[test]
    fn chatml_renders_turns_and_generation_prompt() {
        let template = ChatTemplate::new(CHATML_TEMPLATE, "", "<|im_end|>").expect("compiles");
        assert_eq!(
            template.render(&chat(), false).expect("renders"),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        );
        assert_eq!(
            template.render(&chat()[..1], true).expect("renders"),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn hf_style_templates_with_python_methods_and_exceptions_render() {
        let source = "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n{{ m['role'] }}: {{ m['content'].strip() }}{% endfor %}";
        let template = ChatTemplate::new(source, "<s>", "</s>").expect("compiles");
        let text = template.render(&chat(), false).expect("renders");
        assert_eq!(text, "<s>user: 2+2?assistant: 4");
        let system = [Message {
            role: "system".into(),
            content: "x".into(),
        }];
        let err = template.render(&system, false).expect_err("raises");
        assert!(err.contains("bad role"), "{err}");
    }

    /// Written here in the style of Qwen3's template (tokenizer_config.json
    /// of the Qwen3 models): the constructs it relies on are a reversed
    /// slice, a namespace set in a loop, `is string`, Python string methods
    /// and an empty think block opening the final assistant turn.
    const QWEN3_STYLE: &str = r#"{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for m in messages[::-1] %}
    {%- if m.role == "user" and m.content is string and not m.content.startswith('<tool_response>') and ns.last_user == messages|length - 1 %}
        {%- set ns.last_user = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == "assistant" %}
        {%- set content = m.content.split('</think>')[-1].lstrip('\n') %}
        {%- if loop.index0 > ns.last_user and loop.last %}
            {{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + content.rstrip() + '<|im_end|>\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\n' + m.content.strip() + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

    #[test]
    fn qwen3_style_templates_render_and_split_at_the_final_answer() {
        let template = ChatTemplate::new(QWEN3_STYLE, "", "<|im_end|>").expect("compiles");
        let full = template.render(&chat(), false).expect("renders");
        let prompt = template.render(&chat()[..1], true).expect("renders");
        assert_eq!(
            full,
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
        );
        // padfree's split (tokenize.rs) puts the empty think block in the
        // response, as Qwen3's non-thinking fine-tuning does.
        assert_eq!(
            full.strip_prefix(&prompt),
            Some("<think>\n\n</think>\n\n4<|im_end|>\n")
        );
    }
}
