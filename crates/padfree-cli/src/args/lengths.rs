use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// Where a dataset's example lengths came from.
#[derive(Debug, Clone)]
pub enum LengthSource {
    File(PathBuf),
    /// The examples of a data file.
    Data(PathBuf),
    Synthetic {
        median: usize,
    },
}

impl fmt::Display for LengthSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LengthSource::File(path) => write!(f, "lengths from {}", path.display()),
            LengthSource::Data(path) => write!(f, "the examples of {}", path.display()),
            LengthSource::Synthetic { median } => {
                write!(f, "synthetic lengths (log-normal, median {median} tokens)")
            }
        }
    }
}

/// Reads one positive length per line; blank lines and `#` comments are
/// skipped. Errors name the file, the line and what is wrong.
pub fn read_lengths_file(path: &Path, max_seq_len: usize) -> anyhow::Result<Vec<usize>> {
    let bytes = std::fs::read(path).context("cannot read the file")?;
    let text = String::from_utf8(bytes).map_err(|err| {
        anyhow::anyhow!(
            "{}: byte {} is not UTF-8\nHINT: the lengths file is plain text, one integer per line",
            path.display(),
            err.utf8_error().valid_up_to()
        )
    })?;
    parse_lengths(&text, max_seq_len).map_err(|err| anyhow::anyhow!("{}:{err}", path.display()))
}

fn parse_lengths(text: &str, max_seq_len: usize) -> anyhow::Result<Vec<usize>> {
    let mut lengths = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line_number = number + 1;
        let field = line.split('#').next().unwrap_or("").trim();
        if field.is_empty() {
            continue;
        }
        let len: usize = match field.parse() {
            Ok(len) if len > 0 => len,
            _ => bail!(
                "{line_number}: length '{field}' is not a positive integer\nHINT: write one example length in tokens per line"
            ),
        };
        if len > max_seq_len {
            bail!(
                "{line_number}: length {len} is longer than --max-seq-len {max_seq_len}\nHINT: raise --max-seq-len, or truncate or drop longer examples"
            );
        }
        lengths.push(len);
    }
    if lengths.is_empty() {
        bail!("0: the file holds no lengths\nHINT: write one example length in tokens per line");
    }
    Ok(lengths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lengths_with_comments_and_blank_lines() {
        let lengths = parse_lengths("# lengths\n12\n\n 7 # short\n", 100).expect("parses");
        assert_eq!(lengths, vec![12, 7]);
    }

    #[test]
    fn errors_name_the_line() {
        let err = parse_lengths("3\nabc\n", 100).expect_err("line 2 is bad");
        assert!(err.to_string().starts_with("2: length 'abc'"), "{err}");
        let err = parse_lengths("3\n0\n", 100).expect_err("line 2 is 0");
        assert!(err.to_string().starts_with("2: length '0'"), "{err}");
        let err = parse_lengths("3\n4\n500\n", 100).expect_err("line 3 is too long");
        assert!(
            err.to_string().starts_with("3: length 500 is longer"),
            "{err}"
        );
        assert!(parse_lengths("# nothing\n", 100).is_err());
    }
}
