//! A plain reference parser for the Prometheus text format, written the
//! obvious way (a char cursor, owned strings, no look-ahead tricks), to hold
//! the EPP's allocation-free parser (`kinference_epp::endpoints::prom`)
//! against: its parity tests and its fuzz target both compare line by line.

/// One parsed sample, owned, for comparisons.
#[derive(Debug, Clone)]
pub struct OwnedSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
    pub timestamp: Option<f64>,
}

impl PartialEq for OwnedSample {
    fn eq(&self, o: &Self) -> bool {
        self.name == o.name
            && self.labels == o.labels
            && same_f64(self.value, o.value)
            && match (self.timestamp, o.timestamp) {
                (Some(a), Some(b)) => same_f64(a, b),
                (a, b) => a.is_none() && b.is_none(),
            }
    }
}

/// A line the format does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected;

/// Equal, or both NaN.
pub fn same_f64(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

/// The grammar `prom` documents.
struct Cursor {
    c: Vec<char>,
    i: usize,
}

impl Cursor {
    fn peek(&self) -> Option<char> {
        self.c.get(self.i).copied()
    }

    fn blanks(&mut self) {
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, ch: char) -> Result<(), Rejected> {
        if self.peek() == Some(ch) {
            self.i += 1;
            Ok(())
        } else {
            Err(Rejected)
        }
    }

    /// `"..."`: the raw contents (escapes kept) and the unescaped text.
    fn quoted(&mut self) -> Result<(String, String), Rejected> {
        self.eat('"')?;
        let (mut raw, mut text) = (String::new(), String::new());
        loop {
            match self.peek().ok_or(Rejected)? {
                '"' => {
                    self.i += 1;
                    return Ok((raw, text));
                }
                '\\' => {
                    self.i += 1;
                    let e = self.peek().ok_or(Rejected)?;
                    self.i += 1;
                    raw.push('\\');
                    raw.push(e);
                    text.push(if e == 'n' { '\n' } else { e });
                }
                ch => {
                    self.i += 1;
                    raw.push(ch);
                    text.push(ch);
                }
            }
        }
    }

    fn ident(
        &mut self,
        first: fn(char) -> bool,
        rest: fn(char) -> bool,
    ) -> Result<String, Rejected> {
        let mut out = String::new();
        while let Some(ch) = self.peek() {
            let ok = if out.is_empty() { first(ch) } else { rest(ch) };
            if !ok {
                break;
            }
            out.push(ch);
            self.i += 1;
        }
        if out.is_empty() {
            Err(Rejected)
        } else {
            Ok(out)
        }
    }

    /// Labels up to and including `}`.
    fn labels(&mut self) -> Result<Vec<(String, String)>, Rejected> {
        let mut out = Vec::new();
        loop {
            self.blanks();
            if self.eat('}').is_ok() {
                return Ok(out);
            }
            let key = if self.peek() == Some('"') {
                self.quoted()?.0
            } else {
                self.ident(
                    |c| c.is_ascii_alphabetic() || c == '_',
                    |c| c.is_ascii_alphanumeric() || c == '_',
                )?
            };
            self.blanks();
            self.eat('=')?;
            self.blanks();
            let value = self.quoted()?.1;
            out.push((key, value));
            self.blanks();
            if self.eat('}').is_ok() {
                return Ok(out);
            }
            self.eat(',')?;
        }
    }
}

/// One line: a sample, `None` for a blank or comment line, or `Err` for a
/// line the format does not allow.
pub fn parse_line(line: &str) -> Result<Option<OwnedSample>, Rejected> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let line = line.trim_start_matches([' ', '\t']);
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let mut cur = Cursor {
        c: line.chars().collect(),
        i: 0,
    };
    let (name, labels) = if cur.eat('{').is_ok() {
        cur.blanks();
        let name = cur.quoted()?.0;
        cur.blanks();
        let labels = if cur.eat('}').is_ok() {
            Vec::new()
        } else {
            cur.eat(',')?;
            cur.labels()?
        };
        (name, labels)
    } else {
        let name = cur.ident(
            |c| c.is_ascii_alphabetic() || c == '_' || c == ':',
            |c| c.is_ascii_alphanumeric() || c == '_' || c == ':',
        )?;
        let after_name = cur.i;
        cur.blanks();
        let labels = if cur.eat('{').is_ok() {
            cur.labels()?
        } else {
            cur.i = after_name;
            Vec::new()
        };
        (name, labels)
    };
    if !matches!(cur.peek(), None | Some(' ' | '\t')) {
        return Err(Rejected);
    }
    let rest: String = cur.c[cur.i..].iter().collect();
    let mut fields = rest.split_ascii_whitespace();
    let value = fields
        .next()
        .ok_or(Rejected)?
        .parse()
        .map_err(|_| Rejected)?;
    let timestamp = match fields.next() {
        None | Some("#") => None,
        Some(t) => Some(t.parse().map_err(|_| Rejected)?),
    };
    Ok(Some(OwnedSample {
        name,
        labels,
        value,
        timestamp,
    }))
}
