//! Records of every shape, the errors bad files get, and tokenization with
//! the shipped tokenizer: response-only labels, EOS, the length policy.

use std::path::{Path, PathBuf};

use padfree_data::{
    DataError, FieldNames, Overlong, Record, TextTokenizer, TokenizeConfig, read_records,
    read_records_from_str, tokenize_records,
};
use padfree_pack::IGNORE_INDEX;

fn shipped_tokenizer() -> TextTokenizer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/gsm-symbolic/tokenizer.json");
    TextTokenizer::from_file(&path).expect("the shipped tokenizer loads")
}

fn config(max_seq_len: usize, overlong: Overlong) -> TokenizeConfig {
    TokenizeConfig {
        train_on_inputs: false,
        use_chat_template: false,
        max_seq_len,
        overlong,
        vocab_limit: 8192,
    }
}

fn tokenize(
    records: &[padfree_data::SourceRecord],
    tokenizer: &TextTokenizer,
    config: &TokenizeConfig,
) -> padfree_data::TokenizedDataset {
    tokenize_records(Path::new("d"), records, Some(tokenizer), config).expect("tokenizes")
}

fn parse(text: &str) -> Result<Vec<padfree_data::SourceRecord>, DataError> {
    read_records_from_str(Path::new("data.jsonl"), text, &FieldNames::default())
}

fn error_text(text: &str) -> String {
    parse(text).expect_err("must be refused").to_string()
}

#[test]
fn every_record_shape_is_recognised() {
    let text = r#"{"prompt": "p", "completion": "c"}
{"question": "q", "answer": "a"}

{"instruction": "i", "input": "", "output": "o"}
{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
"#;
    let records = parse(text).expect("parses");
    assert_eq!(records.len(), 5);
    assert_eq!(
        records[2].location, "line 4",
        "blank lines keep line numbers"
    );
    assert!(matches!(records[0].record, Record::PromptCompletion { .. }));
    assert!(matches!(records[1].record, Record::QuestionAnswer { .. }));
    assert!(matches!(records[2].record, Record::Alpaca { .. }));
    assert!(matches!(records[3].record, Record::Chat { .. }));
    assert_eq!(
        records[4].record,
        Record::Tokenized {
            input_ids: vec![1, 2, 3],
            labels: Some(vec![-100, 2, 3])
        }
    );
    let array = r#"[{"question": "q", "answer": "a"}, {"question": "q2", "answer": "a2"}]"#;
    let records =
        read_records_from_str(Path::new("d.json"), array, &FieldNames::default()).expect("array");
    assert_eq!(records[1].location, "element 1");
    let renamed = FieldNames {
        prompt: Some("src".into()),
        completion: Some("tgt".into()),
        ..FieldNames::default()
    };
    let records = read_records_from_str(
        Path::new("d.jsonl"),
        r#"{"src": "x", "tgt": "y"}"#,
        &renamed,
    )
    .expect("renamed");
    assert_eq!(
        records[0].record,
        Record::PromptCompletion {
            prompt: "x".into(),
            completion: "y".into()
        }
    );
}

#[test]
fn bad_records_are_refused_with_file_line_and_field() {
    let good = r#"{"prompt": "p", "completion": "c"}"#;
    let cases = [
        (
            format!("{good}\n{{\"prompt\": \"p\", \"completion\": }}"),
            "data.jsonl:line 2: not valid JSON",
        ),
        (
            format!("{good}\n{good}\n{{\"prompt\": \"p\"}}"),
            "data.jsonl:line 3: field `completion` is missing",
        ),
        (
            r#"{"question": "  ", "answer": "a"}"#.to_owned(),
            "line 1: field `question` is empty",
        ),
        (
            r#"{"prompt": 3, "completion": "c"}"#.to_owned(),
            "field `prompt` must be a string, found a number",
        ),
        (
            r#"{"body": "t"}"#.to_owned(),
            "no known record shape; the record has fields: body",
        ),
        (r#"[1]"#.to_owned(), "expected a JSON object"),
        (
            r#"{"messages": [{"role": "user", "content": "u"}]}"#.to_owned(),
            "must be a non-empty assistant turn",
        ),
        (
            r#"{"messages": [{"role": "robot", "content": "u"}]}"#.to_owned(),
            "`messages[0].role` is `robot`",
        ),
        (
            r#"{"input_ids": [1, 2], "labels": [1]}"#.to_owned(),
            "`labels` has 1 entries for 2 `input_ids`",
        ),
        (
            r#"{"input_ids": [1, -2]}"#.to_owned(),
            "`input_ids[1]` is -2",
        ),
        ("\n\n".to_owned(), "the file holds no records"),
    ];
    for (text, expected) in cases {
        let err = error_text(&text);
        assert!(err.contains(expected), "expected `{expected}` in:\n{err}");
        assert!(err.contains("HINT:"), "no hint in:\n{err}");
    }
}

#[test]
fn non_utf8_is_refused_with_its_line() {
    let dir = tempfile::Builder::new()
        .prefix("padfree-data-utf8-")
        .tempdir()
        .expect("scratch dir");
    let path: PathBuf = dir.path().join("latin1.jsonl");
    let mut bytes = b"{\"prompt\": \"p\", \"completion\": \"c\"}\n".to_vec();
    bytes.extend(b"{\"prompt\": \"caf\xe9\", \"completion\": \"c\"}\n");
    std::fs::write(&path, bytes).expect("write");
    let err = read_records(&path, &FieldNames::default())
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("latin1.jsonl:line 2: not valid UTF-8"),
        "{err}"
    );
    let missing = read_records(&dir.path().join("absent.jsonl"), &FieldNames::default())
        .expect_err("refused");
    assert!(missing.to_string().contains("absent.jsonl"), "{missing}");
}

#[test]
fn loss_is_on_the_response_and_eos_unless_inputs_are_trained() {
    let tokenizer = shipped_tokenizer();
    let records = parse(r#"{"question": "How many apples?", "answer": "3 + 4 = 7\n#### 7"}"#)
        .expect("parses");
    let data = tokenize(&records, &tokenizer, &config(512, Overlong::Truncate));
    let example = &data.examples[0];
    let prompt_len = tokenizer
        .encode("Question: How many apples?\nAnswer: ", true)
        .expect("encodes")
        .len();
    let response = tokenizer
        .encode("3 + 4 = 7\n#### 7", false)
        .expect("encodes");
    assert_eq!(example.len(), prompt_len + response.len() + 1);
    assert!(
        example.labels()[..prompt_len]
            .iter()
            .all(|&l| l == IGNORE_INDEX)
    );
    let labelled: Vec<i64> = example.labels()[prompt_len..].to_vec();
    let mut expected: Vec<i64> = response.iter().map(|&id| i64::from(id)).collect();
    expected.push(i64::from(tokenizer.eos_id()));
    assert_eq!(labelled, expected);
    assert_eq!(
        *example.input_ids().last().expect("non-empty"),
        tokenizer.eos_id()
    );
    let decoded = tokenizer.decode(example.input_ids()).expect("decodes");
    assert_eq!(
        decoded,
        "Question: How many apples?\nAnswer: 3 + 4 = 7\n#### 7<|endoftext|>"
    );

    let all = TokenizeConfig {
        train_on_inputs: true,
        ..config(512, Overlong::Truncate)
    };
    let data = tokenize(&records, &tokenizer, &all);
    assert_eq!(
        data.examples[0].num_loss_tokens(),
        data.examples[0].len() - 1
    );
}

#[test]
fn chat_records_split_at_the_final_assistant_turn() {
    let tokenizer = shipped_tokenizer();
    assert!(tokenizer.has_own_chat_template());
    let records = parse(r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}"#).expect("parses");
    let data = tokenize(&records, &tokenizer, &config(512, Overlong::Truncate));
    let example = &data.examples[0];
    let first_labelled = example
        .labels()
        .iter()
        .position(|&l| l != IGNORE_INDEX)
        .expect("has labels");
    let prompt = tokenizer
        .decode(&example.input_ids()[..first_labelled])
        .expect("decodes");
    let response = tokenizer
        .decode(&example.input_ids()[first_labelled..])
        .expect("decodes");
    assert_eq!(
        prompt,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(response, "4<|im_end|>\n<|endoftext|>");

    // --use-chat-template renders a question/answer record the same way.
    let qa = parse(r#"{"question": "2+2?", "answer": "4"}"#).expect("parses");
    let chat = TokenizeConfig {
        use_chat_template: true,
        ..config(512, Overlong::Truncate)
    };
    let data = tokenize(&qa, &tokenizer, &chat);
    let text = tokenizer
        .decode(data.examples[0].input_ids())
        .expect("decodes");
    assert_eq!(
        text,
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|endoftext|>"
    );
}

#[test]
fn overlong_examples_are_truncated_or_dropped_and_counted() {
    let tokenizer = shipped_tokenizer();
    let long_answer = "7 ".repeat(100);
    let text = format!(
        "{{\"question\": \"short?\", \"answer\": \"yes\"}}\n{{\"question\": \"long?\", \"answer\": \"{long_answer}\"}}\n{{\"question\": \"{}\", \"answer\": \"x\"}}",
        "word ".repeat(100)
    );
    let records = parse(&text).expect("parses");
    let truncated = tokenize(&records, &tokenizer, &config(40, Overlong::Truncate));
    // The third record's prompt alone fills 40 tokens: no label left, dropped.
    assert_eq!(
        (
            truncated.report.truncated,
            truncated.report.dropped_no_labels
        ),
        (2, 1)
    );
    assert_eq!(truncated.examples.len(), 2);
    assert!(truncated.examples.iter().all(|e| e.len() <= 40));
    assert_eq!(truncated.locations, vec!["line 1", "line 2"]);
    let dropped = tokenize(&records, &tokenizer, &config(40, Overlong::Drop));
    assert_eq!(
        (dropped.report.dropped_overlong, dropped.examples.len()),
        (2, 1)
    );
    assert!(dropped.report.to_string().contains("2 dropped as too long"));
}

#[test]
fn token_ids_outside_the_model_vocabulary_are_refused() {
    let records = parse(r#"{"input_ids": [1, 9000]}"#).expect("parses");
    let err = tokenize_records(
        Path::new("d.jsonl"),
        &records,
        None,
        &config(64, Overlong::Truncate),
    )
    .expect_err("refused");
    assert!(
        err.to_string().contains(
            "d.jsonl:line 1: token id 9000 at position 1 is outside the model's vocabulary of 8192"
        ),
        "{err}"
    );
    let text = parse(r#"{"prompt": "p", "completion": "c"}"#).expect("parses");
    let err = tokenize_records(
        Path::new("d.jsonl"),
        &text,
        None,
        &config(64, Overlong::Truncate),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("needs a tokenizer"), "{err}");
}

#[test]
fn text_records_put_the_loss_on_every_token() {
    let tokenizer = shipped_tokenizer();
    // `{text}` alone is raw text; a leading byte-order mark is not data.
    let records = read_records_from_str(
        Path::new("corpus.jsonl"),
        "\u{feff}{\"text\": \"Seven apples and three pears.\"}\n",
        &FieldNames::default(),
    )
    .expect("parses");
    assert_eq!(
        records[0].record,
        Record::Text {
            text: "Seven apples and three pears.".into()
        }
    );
    let data = tokenize(&records, &tokenizer, &config(512, Overlong::Truncate));
    let example = &data.examples[0];
    let text = tokenizer
        .encode("Seven apples and three pears.", false)
        .expect("encodes");
    let bos = tokenizer.encode("", true).expect("encodes").len();
    assert_eq!(example.len(), bos + text.len() + 1);
    // Every token but the specials before the text carries loss, EOS too.
    assert_eq!(example.num_loss_tokens(), example.len() - bos.max(1));
    // Another field name, as TRL's dataset_text_field.
    let named = FieldNames {
        text: Some("content".into()),
        ..FieldNames::default()
    };
    let records = read_records_from_str(
        Path::new("corpus.jsonl"),
        r#"{"content": "x", "id": 7}"#,
        &named,
    )
    .expect("parses");
    assert_eq!(records[0].record, Record::Text { text: "x".into() });
    let message = read_records_from_str(Path::new("corpus.jsonl"), r#"{"id": 7}"#, &named)
        .expect_err("no content field")
        .to_string();
    assert!(message.contains("field `content` is missing"), "{message}");
}

/// ASDiv's shape: `passage` beside `question` and `answer`.
const ASDIV: &str = r#"{"passage": "Ann has 3 apples and buys 2 more.", "question": "How many apples?", "answer": "5", "id": "nluds-0001", "grade": 1}
{"passage": "Bob had 7 pens. He gave 4 away.", "question": "How many are left?", "answer": "3", "id": "nluds-0002", "grade": 2}
"#;

#[test]
fn text_fields_a_record_shape_does_not_use_are_named() {
    let records = parse(ASDIV).expect("question/answer records");
    assert!(matches!(records[0].record, Record::QuestionAnswer { .. }));
    // `id` (no space) and `grade` (a number) are metadata, not text.
    assert_eq!(records[0].unused_text_fields, ["passage"]);
    let unused = padfree_data::unused_text_fields(&records);
    assert_eq!(
        unused,
        [padfree_data::UnusedField {
            name: "passage".into(),
            records: 2,
            first: "line 1".into(),
            beside: vec!["question".into(), "answer".into()],
            prompted: true,
        }]
    );
    // Every shape uses what it reads: nothing named for records without extras.
    let plain = parse(
        r#"{"prompt": "a b", "completion": "c d"}
{"instruction": "a b", "input": "c d", "output": "e f"}
{"messages": [{"role": "user", "content": "u v"}, {"role": "assistant", "content": "a b"}]}
{"input_ids": [1, 2], "text": "the text it came from"}
"#,
    )
    .expect("parses");
    assert!(padfree_data::unused_text_fields(&plain).is_empty());
}

#[test]
fn a_prompt_template_builds_the_prompt_from_several_fields() {
    let fields = FieldNames {
        prompt_template: Some(r"{passage}\n{question} (grade {grade}) {{x}}".into()),
        completion: Some("answer".into()),
        ..FieldNames::default()
    };
    let records = read_records_from_str(Path::new("asdiv.jsonl"), ASDIV, &fields).expect("reads");
    assert_eq!(
        records[1].record,
        Record::PromptCompletion {
            prompt: "Bob had 7 pens. He gave 4 away.\nHow many are left? (grade 2) {x}".into(),
            completion: "3".into(),
        }
    );
    assert!(records[1].unused_text_fields.is_empty());
    // A field the template names that a record lacks: file, line, field.
    let err = read_records_from_str(
        Path::new("asdiv.jsonl"),
        "{\"question\": \"q\", \"answer\": \"a\"}\n",
        &fields,
    )
    .expect_err("no passage")
    .to_string();
    assert!(
        err.starts_with("asdiv.jsonl:line 1: --prompt-template: field `passage` is missing"),
        "{err}"
    );
    for (bad, why) in [
        ("{passage", "is not closed"),
        ("no fields", "names no field"),
        ("a } b {x}", "a lone `}`"),
        ("{}", "is not a field"),
    ] {
        let message = padfree_data::template_fields(bad).expect_err(bad);
        assert!(message.contains(why), "{bad}: {message}");
    }
}

/// A template renders a number field as the file writes it, in JSONL and
/// in a JSON array alike: a 23-digit integer, trailing zeros, exponents,
/// negative numbers and `-0` (the parsed f64 would print
/// `1.2345678901234568e22`, `0.5`, `100.0`, ...).
#[test]
fn a_prompt_template_renders_numbers_as_the_file_writes_them() {
    let fields = FieldNames {
        prompt_template: Some("{a} {b} {c} {d} {e} {f} {g}: {q}".into()),
        completion: Some("answer".into()),
        ..FieldNames::default()
    };
    let numbers = r#""a": 12345678901234567890123, "b": 0.50, "c": 2.500, "d": 1e2, "e": -7, "f": -0, "g": 6.02E+23"#;
    let written = "12345678901234567890123 0.50 2.500 1e2 -7 -0 6.02E+23: how many?";
    let record = format!(r#"{{{numbers}, "q": "how many?", "answer": "x"}}"#);
    for (path, text) in [
        ("numbers.jsonl", format!("{record}\n")),
        ("numbers.json", format!("[\n  {record},\n  {record}\n]\n")),
    ] {
        let records = read_records_from_str(Path::new(path), &text, &fields).expect("reads");
        for source in &records {
            assert_eq!(
                source.record,
                Record::PromptCompletion {
                    prompt: written.into(),
                    completion: "x".into(),
                },
                "{path}"
            );
        }
    }
}

#[test]
fn one_token_examples_are_refused_with_a_hint_that_fits() {
    let tokenizer = shipped_tokenizer();
    let records = parse("{\"input_ids\": [5]}\n{\"input_ids\": [7]}\n").expect("parses");
    for train_on_inputs in [false, true] {
        let config = TokenizeConfig {
            train_on_inputs,
            ..config(2048, Overlong::Truncate)
        };
        let err = tokenize_records(Path::new("d"), &records, Some(&tokenizer), &config)
            .expect_err("no label")
            .to_string();
        assert!(err.contains("every example is a single token"), "{err}");
        assert!(!err.contains("--train-on-inputs"), "{err}");
    }
    // Cut so short that no response token is left: raise --max-seq-len, not
    // the --overlong default.
    let long = parse(r#"{"prompt": "a long prompt of many words here", "completion": "yes"}"#)
        .expect("parses");
    let err = tokenize_records(
        Path::new("d"),
        &long,
        Some(&tokenizer),
        &config(3, Overlong::Truncate),
    )
    .expect_err("nothing left")
    .to_string();
    assert!(err.contains("raise --max-seq-len"), "{err}");
    assert!(!err.contains("--overlong truncate"), "{err}");
}

#[test]
fn tokenizers_are_compared_id_by_id() {
    let shipped = shipped_tokenizer();
    let same = shipped.differences_from(&shipped);
    assert!(!same.disagrees());
    assert_eq!(same.sizes, (shipped.vocab_size(), shipped.vocab_size()));
    // A tokenizer whose ids mean other tokens: its vocabulary reversed.
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/gsm-symbolic/tokenizer.json"),
        )
        .expect("reads"),
    )
    .expect("json");
    let mut other = json.clone();
    let vocab = other["model"]["vocab"]
        .as_object_mut()
        .expect("a vocab map");
    let size = vocab.len() as u64;
    for id in vocab.values_mut() {
        *id = serde_json::json!(size - 1 - id.as_u64().expect("ids"));
    }
    let other =
        TextTokenizer::from_bytes("reversed", other.to_string().as_bytes(), None).expect("loads");
    let difference = other.differences_from(&shipped);
    assert!(difference.disagrees());
    assert!(difference.differing > 1000, "{difference:?}");
}
