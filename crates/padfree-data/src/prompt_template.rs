//! `--prompt-template`: its syntax (`{field}`, `{{`, `}}`, `\n`, `\t`,
//! `\\`), the fields it names, and rendering it from a record's values
//! (which the record reader looks up: `records.rs`).

/// The pieces of a `--prompt-template`: literal text and field names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Field(String),
}

/// Parses a template: `{name}` is a field, `{{` and `}}` are braces, `\n`
/// and `\t` a newline and a tab, `\\` a backslash.
fn pieces(template: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let mut name = String::new();
                let mut closed = false;
                for c in chars.by_ref() {
                    if c == '}' {
                        closed = true;
                        break;
                    }
                    name.push(c);
                }
                if !closed {
                    return Err(format!("`{{{name}` is not closed: write {{field}}"));
                }
                if name.is_empty() || name.contains('{') {
                    return Err(format!(
                        "`{{{name}` is not a field: write {{field}}, or {{{{ for a brace"
                    ));
                }
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                pieces.push(Piece::Field(name));
            }
            '}' => return Err("a lone `}`: write }} for a brace".into()),
            // A template comes from a shell, where a newline is awkward to type.
            '\\' => match chars.next() {
                Some('n') => text.push('\n'),
                Some('t') => text.push('\t'),
                Some('\\') => text.push('\\'),
                Some(other) => {
                    text.push('\\');
                    text.push(other);
                }
                None => text.push('\\'),
            },
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    if !pieces.iter().any(|p| matches!(p, Piece::Field(_))) {
        return Err("it names no field: write {field} where a record's field goes".into());
    }
    Ok(pieces)
}

/// The fields a template names, or why it is not one.
pub fn template_fields(template: &str) -> Result<Vec<String>, String> {
    Ok(PromptTemplate::parse(template)?.fields())
}

/// A parsed `--prompt-template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PromptTemplate {
    pieces: Vec<Piece>,
}

impl PromptTemplate {
    /// The template, or why it is not one.
    pub(crate) fn parse(template: &str) -> Result<Self, String> {
        Ok(Self {
            pieces: pieces(template)?,
        })
    }

    /// The field names it holds, in order.
    pub(crate) fn fields(&self) -> Vec<String> {
        self.pieces
            .iter()
            .filter_map(|piece| match piece {
                Piece::Field(name) => Some(name.clone()),
                Piece::Text(_) => None,
            })
            .collect()
    }

    /// The text with every field replaced by `value(name)`, which may
    /// refuse the record.
    pub(crate) fn render<E>(
        &self,
        mut value: impl FnMut(&str) -> Result<String, E>,
    ) -> Result<String, E> {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::Field(name) => out.push_str(&value(name)?),
            }
        }
        Ok(out)
    }
}
