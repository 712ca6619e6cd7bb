//! Detects source code (and close relatives: stack traces, compiler errors,
//! config files) pasted into a prompt.
//!
//! The question answered is "does the prompt contain code", not "is it about
//! programming": "write a function that reverses a string" is `code-none`, so
//! that a policy can route pasted proprietary code differently from a coding
//! question. A single line of syntax is `code-unknown`: it may be code or a
//! sentence that happens to look like it, and a policy must decide.

use std::sync::LazyLock;

use regex::Regex;
use regex::bytes::{Regex as BytesRegex, RegexSet};

/// Every tag the code classifier can emit.
pub const TAGS: &[&str] = &["code-confirmed", "code-none", "code-unknown"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodeVerdict {
    Confirmed,
    None,
    Unknown,
}

impl CodeVerdict {
    pub fn tag(self) -> &'static str {
        match self {
            CodeVerdict::Confirmed => "code-confirmed",
            CodeVerdict::None => "code-none",
            CodeVerdict::Unknown => "code-unknown",
        }
    }
}

/// Lines needed in one cluster of code before unfenced text counts as code.
pub const CLUSTER_LINES: usize = 3;

/// What the scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodeEvidence {
    /// Non-blank lines.
    pub lines: usize,
    /// Fenced blocks whose language is a programming or config language, or
    /// unlabelled blocks holding at least one code-like line.
    pub fenced_blocks: usize,
    /// Lines that look like code outside those blocks.
    pub code_lines: usize,
    /// Longest run of code lines, where single non-code lines between them do
    /// not break the run (a comment or a prose line in a paste).
    pub largest_cluster: usize,
    /// `inline` backtick spans that contain syntax.
    pub inline_snippets: usize,
    /// The whole prompt is a short string dense in symbols (`x => x * 2`).
    pub symbolic: bool,
}

impl CodeEvidence {
    pub fn verdict(&self) -> CodeVerdict {
        if self.lines == 0 {
            CodeVerdict::Unknown
        } else if self.fenced_blocks > 0 || self.largest_cluster >= CLUSTER_LINES {
            CodeVerdict::Confirmed
        } else if self.code_lines > 0 || self.inline_snippets > 0 || self.symbolic {
            CodeVerdict::Unknown
        } else {
            CodeVerdict::None
        }
    }
}

/// Stops reading at the first proof of code: nothing after it can change the
/// verdict, and pasted sources are the long prompts.
pub fn classify_code(prompt: &str) -> CodeVerdict {
    scan(prompt, true).verdict()
}

/// Scans the whole prompt line by line. Linear in its length.
pub fn analyze(prompt: &str) -> CodeEvidence {
    scan(prompt, false)
}

fn scan(prompt: &str, stop_when_confirmed: bool) -> CodeEvidence {
    let mut ev = CodeEvidence::default();
    let mut fence: Option<Fence> = None;
    let mut cluster = Cluster::default();
    let mut prev_code = false;

    for line in prompt.lines() {
        let trimmed = line.trim();
        if let Some(marker) = fence_marker(trimmed) {
            // A closing fence carries no info string; "```js" inside a block
            // is content.
            let closes = trimmed[3..]
                .trim_start_matches(marker.as_bytes()[0] as char)
                .trim()
                .is_empty();
            match fence.take() {
                Some(open) if open.marker == marker && closes => {
                    ev.fenced_blocks += usize::from(open.counts());
                    if stop_when_confirmed && ev.fenced_blocks > 0 {
                        return ev;
                    }
                    continue;
                }
                Some(open) => fence = Some(open),
                None => {
                    fence = Some(Fence::open(marker, &trimmed[3..]));
                    continue;
                }
            }
        }
        if trimmed.is_empty() {
            continue;
        }
        ev.lines += 1;
        if let Some(open) = fence.as_mut() {
            open.content_lines += 1;
            // Blocks labelled as prose or logs are read like the rest of the
            // prompt, since code pasted into them is still code.
            if !open.is_prose() {
                // Only unlabelled blocks are judged by their lines.
                if open.lang.is_empty() {
                    open.code_lines += usize::from(line_is_code(trimmed));
                }
                continue;
            }
        }
        // An indented line under a line of code continues it (Python bodies,
        // YAML children), but indentation alone proves nothing in prose.
        let indented_continuation =
            prev_code && line.starts_with([' ', '\t']) && has_code_punctuation(trimmed);
        let is_code = line_is_code(trimmed) || indented_continuation;
        if is_code {
            ev.code_lines += 1;
        }
        cluster.push(is_code);
        ev.largest_cluster = ev.largest_cluster.max(cluster.len);
        prev_code = is_code;
        if stop_when_confirmed && ev.largest_cluster >= CLUSTER_LINES {
            return ev;
        }
    }
    // An unterminated fence still delimits what the user meant as code.
    if let Some(open) = fence {
        ev.fenced_blocks += usize::from(open.counts());
    }
    ev.inline_snippets = INLINE
        .captures_iter(prompt)
        .filter(|c| has_code_punctuation(&c[1]))
        .take(64)
        .count();
    ev.symbolic = is_symbolic(prompt);
    ev
}

#[derive(Default)]
struct Cluster {
    len: usize,
    gap: bool,
}

impl Cluster {
    fn push(&mut self, is_code: bool) {
        if is_code {
            self.len += 1;
            self.gap = false;
        } else if self.gap || self.len == 0 {
            self.len = 0;
            self.gap = false;
        } else {
            self.gap = true;
        }
    }
}

struct Fence {
    marker: &'static str,
    lang: String,
    content_lines: usize,
    code_lines: usize,
}

impl Fence {
    fn open(marker: &'static str, info: &str) -> Self {
        let lang = info
            .split(|c: char| c.is_whitespace() || c == '{' || c == ',')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        Fence {
            marker,
            lang,
            content_lines: 0,
            code_lines: 0,
        }
    }

    fn is_prose(&self) -> bool {
        const PROSE: &[&str] = &[
            "text",
            "txt",
            "plaintext",
            "plain",
            "markdown",
            "md",
            "log",
            "output",
            "email",
            "quote",
        ];
        PROSE.contains(&self.lang.as_str())
    }

    /// Fences are also used for quoting prose, logs and emails, so a block
    /// counts as code if its label names a language or, unlabelled, if it
    /// has a line that looks like code.
    fn counts(&self) -> bool {
        if self.content_lines == 0 || self.is_prose() {
            return false;
        }
        !self.lang.is_empty() || self.code_lines > 0
    }
}

fn fence_marker(trimmed: &str) -> Option<&'static str> {
    if trimmed.starts_with("```") {
        Some("```")
    } else if trimmed.starts_with("~~~") {
        Some("~~~")
    } else {
        None
    }
}

/// Whether one trimmed, non-blank line looks like code.
pub fn line_is_code(line: &str) -> bool {
    if line.len() > 2000 {
        return minified(line);
    }
    may_be_code(line) && (matches_code_pattern(line) || minified(line)) && !looks_like_prose(line)
}

/// Anchored patterns fail within a few bytes on prose, so they run as one
/// set; the few that can match anywhere in a line run only when the line holds
/// the punctuation they need.
fn matches_code_pattern(line: &str) -> bool {
    let b = line.as_bytes();
    let anywhere = line.ends_with(';')
        || line.ends_with('{')
        || line.contains("=>")
        || line.contains("?.")
        || line.contains("::")
        || line.contains(").");
    CODE_LINE_START.is_match(b) || (anywhere && CODE_LINE_ANYWHERE.is_match(b))
}

/// A necessary condition for [`matches_code_pattern`] or [`minified`] to match, cheap
/// enough to run on every line: each pattern needs one of these bytes or
/// starts with one of these words. Most prose lines fail it and skip the
/// regex set. A unit test checks that it never rejects a line the set accepts.
fn may_be_code(line: &str) -> bool {
    const FIRST_WORDS: &[&str] = &[
        "def",
        "class",
        "async",
        "if",
        "elif",
        "while",
        "for",
        "else",
        "try",
        "finally",
        "except",
        "with",
        "return",
        "yield",
        "raise",
        "await",
        "import",
        "from",
        "use",
        "package",
        "using",
        "require",
        "mod",
        "pub",
        "fn",
        "const",
        "unsafe",
        "public",
        "private",
        "protected",
        "static",
        "final",
        "abstract",
        "override",
        "internal",
        "virtual",
        "export",
        "default",
        "function",
        "let",
        "var",
        "interface",
        "struct",
        "enum",
        "trait",
        "impl",
        "type",
        "union",
        "switch",
        "catch",
        "foreach",
        "int",
        "void",
        "char",
        "float",
        "double",
        "bool",
        "long",
        "unsigned",
        "size_t",
        "auto",
        "String",
        "val",
        "func",
        "go",
        "curl",
        "wget",
        "ssh",
        "scp",
        "tar",
        "grep",
        "sed",
        "awk",
        "chmod",
        "chown",
        "ls",
        "rm",
        "cp",
        "mv",
        "cat",
        "echo",
        "mkdir",
        "cd",
        "set",
        "sudo",
        "npm",
        "yarn",
        "pnpm",
        "pip",
        "pip3",
        "cargo",
        "docker",
        "kubectl",
        "git",
        "apt-get",
        "apt",
        "brew",
        "helm",
        "terraform",
        "Traceback",
        "File",
        "panicked",
        "error",
        "warning",
        "FROM",
        "RUN",
        "COPY",
        "ADD",
        "WORKDIR",
        "CMD",
        "ENTRYPOINT",
        "ENV",
        "EXPOSE",
        "ARG",
        "SELECT",
        "INSERT",
        "UPDATE",
        "DELETE",
        "CREATE",
        "ALTER",
        "DROP",
        "WHERE",
        "JOIN",
        "LEFT",
        "INNER",
        "RIGHT",
        "GROUP",
        "ORDER",
        "HAVING",
        "select",
        "std",
        "apiVersion",
        "kind",
        "metadata",
        "spec",
        "services",
        "version",
    ];
    let b = line.as_bytes();
    let (mut colon, mut quote) = (false, false);
    for (i, &c) in b.iter().enumerate() {
        let next = b.get(i + 1).copied();
        match c {
            b'(' | b')' | b'{' | b'}' | b'[' | b']' | b';' | b'=' | b'<' | b'>' | b'$' | b'#'
            | b'@' | b'|' | b'\\' | b'+' | b'*' | b'/' | b'&' | b'%' | b'^' | b'~' => return true,
            b':' if next == Some(b':') => return true,
            b'-' if next == Some(b'-') => return true,
            b'?' if next == Some(b'.') => return true,
            b':' => colon = true,
            b'"' => quote = true,
            _ => {}
        }
    }
    if line.starts_with('-')
        || line.ends_with(':')
        || (colon && quote)
        || (colon && (line.contains("Error:") || line.contains("Exception:")))
    {
        return true;
    }
    let first = line
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .next()
        .unwrap_or_default();
    FIRST_WORDS.contains(&first)
}

/// Sentences with many plain words and little punctuation are prose even
/// when they start with a keyword ("return the form by Friday").
fn looks_like_prose(line: &str) -> bool {
    let words = line.split_whitespace().count();
    let plain_words = line
        .split_whitespace()
        .filter(|w| {
            let w = w.trim_end_matches([',', '.', '!', '?', ':', ';']);
            // All-caps words are keywords (SELECT, WHERE, NULL) more often
            // than prose.
            let shouting = w.len() > 1 && w.chars().all(|c| c.is_ascii_uppercase());
            w.chars().all(char::is_alphabetic) && !shouting
        })
        .count();
    let syntax = line
        .matches(['(', ')', '{', '}', '=', ';', '[', ']', '<', '>'])
        .count();
    words >= 8 && plain_words * 4 >= words * 3 && syntax <= 2
}

/// Many statements on one line: minified or one-liner code.
fn minified(line: &str) -> bool {
    let statements = line.matches(';').count();
    let braces = line.matches(['{', '}']).count();
    statements >= 3 && braces >= 2
}

fn has_code_punctuation(s: &str) -> bool {
    CODE_PUNCTUATION.is_match(s)
}

/// A short prompt made mostly of operators and identifiers.
fn is_symbolic(prompt: &str) -> bool {
    let trimmed = prompt.trim();
    if trimmed.len() > 400 {
        return false;
    }
    let visible = trimmed.chars().filter(|c| !c.is_whitespace()).count();
    if visible == 0 || visible > 60 {
        return false;
    }
    let symbols = trimmed
        .chars()
        .filter(|c| "{}[]()<>=;+-*/%&|!^~:.$@#\\".contains(*c))
        .count();
    symbols * 5 >= visible && has_code_punctuation(trimmed)
}

/// Compiles every pattern of this module now rather than on first use.
pub(crate) fn warm_up() {
    LazyLock::force(&CODE_LINE_START);
    LazyLock::force(&CODE_LINE_ANYWHERE);
    LazyLock::force(&CODE_PUNCTUATION);
    LazyLock::force(&INLINE);
}

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).expect("built-in pattern compiles")
}

// One alternative per family of syntax. Each requires punctuation or a
// keyword in a position prose does not use, because English shares most
// keywords (if, for, while, return, import, class). Matched on bytes with
// Unicode off: syntax is ASCII, and ASCII classes keep the DFA small and fast
// on non-English text.
static CODE_LINE_START: LazyLock<RegexSet> = LazyLock::new(|| {
    let patterns = [
        // Python definitions and block openers.
        r"^(?:async\s+)?(?:def|class)\s+[A-Za-z_]\w*\s*(?:\(.*\))?\s*(?:->\s*[^:]+)?:$",
        r"^(?:if|elif|while)\s+.*(?:[=<>!]=|[<>]|\bnot\b|\bin\b|\bis\b|\w\(|\)).*:$",
        r"^for\s+[\w, ()]+\s+in\s+.+:$",
        r"^(?:else|try|finally)\s*:$|^except(?:\s+[\w.]+(?:\s+as\s+\w+)?)?\s*:$|^with\s+.+\s+as\s+\w+\s*:$",
        r"^(?:return|yield|raise|await)(?:\s+[\w.\[\]()'\x22+\-*/%<>=!, ]+)?;?$",
        // Imports and module declarations.
        r"^(?:import\s+[\w.]+(?:\s+as\s+\w+)?|from\s+[\w.]+\s+import\s+[\w*, ()]+|import\s+.*\s+from\s+['\x22].+['\x22];?|use\s+[\w:{}, *]+;|#include\s*[<\x22].+[>\x22]|package\s+[\w.]+;?|using\s+[\w.]+;|require\(.+\);?|mod\s+\w+;)$",
        // C-family declarations, control flow and blocks.
        r"^(?:pub(?:\([\w:]+\))?\s+)?(?:async\s+|const\s+|unsafe\s+)*fn\s+\w+\s*[<(]",
        r"^(?:(?:public|private|protected|static|final|abstract|override|internal|virtual|export|default)\s+)+[\w<>\[\],.? ]*[\w>\]]\s*[({=;]",
        r"^(?:export\s+)?(?:async\s+)?function\s*\*?\s*\w*\s*\(",
        r"^(?:export\s+)?(?:const|let|var)\s+(?:mut\s+)?[\w{}\[\], ]+\s*(?::\s*[\w<>\[\]&', ]+)?\s*=",
        r"^(?:export\s+)?(?:interface|struct|enum|trait|impl|type|class|union)\s+[\w<>, :]+\s*(?:\{|=|\(|;|where|extends|implements)",
        r"^(?:if|for|while|switch|catch|foreach)\s*\(.*\)\s*\{?$",
        r"^\}\s*(?:else(?:\s+if\s*\(.*\))?|catch\s*\(.*\)|finally)?\s*\{?$|^[}\])]+[;,)]*$",
        r"^(?:int|void|char|float|double|bool|long|unsigned|size_t|auto|std::\w+|String|let|var|val)\s+\**\w+(?:\s*\[.*\])?\s*(?:=|\(|;)",
        r"^func\s+(?:\([^)]*\)\s*)?\w+\s*\(",
        // Statements: assignments, calls, method chains.
        r"^[A-Za-z_$][\w$]*(?:(?:\.|->|::)[A-Za-z_$][\w$]*|\[[^\]]*\])*\s*(?:[+\-*/%|&^]?=|:=|\?\?=)\s*[^=\s].*$",
        r"^[A-Za-z_$][\w$]*(?:(?:\.|::|->)[A-Za-z_$][\w$]*)*\(.*\)\s*;?$",
        r"^\.\w+\(.*\)\s*;?\)*;?$",
        r"^[\w$.]+\s*(?:\+\+|--);?$",
        r"^@[A-Za-z_][\w.]*(?:\(.*\))?$|^#\[[\w(), =\x22]+\]$|^#!/",
        // Language openers and closers; Lisp forms; Dockerfile instructions.
        r"^<\?(?:php|xml)\b|^\?>$",
        r"^\((?:defn-?|defun|defmacro|define|defvar|ns|require|let|lambda|setq|[*+/<>=-])\s",
        r"^\([\w?!*+<>=/.-]+\s.*[\[(].*\)$",
        r"^(?:FROM\s+[\w./:@-]+(?:\s+AS\s+\w+)?|RUN\s+.+|(?:COPY|ADD)\s+\S+\s+\S+|WORKDIR\s+\S+|(?:CMD|ENTRYPOINT)\s+.+|ENV\s+\w+[= ].+|EXPOSE\s+[0-9]+|ARG\s+\w+.*)$",
        // Markup and data.
        r"^</?[A-Za-z][\w:-]*(?:\s+[\w:@.-]+(?:=(?:\x22[^\x22]*\x22|'[^']*'|\{[^}]*\}|[\w.-]+))?)*\s*/?>",
        r"^\x22[^\x22]+\x22\s*:\s*(?:\x22[^\x22]*\x22|-?[0-9.]+|true|false|null|\{|\[)\s*,?$",
        r"^[{\[]$",
        r"^(?:apiVersion|kind|metadata|spec|services|version):\s*\S*$",
        // SQL (upper-case keywords: lower-case "select ... from" is English).
        r"^(?:SELECT\s+.+(?:\s+FROM\b|,$)|SELECT\s+\S+$|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+(?:TABLE|INDEX|VIEW|UNIQUE)|ALTER\s+TABLE|DROP\s+TABLE|FROM\s+\w+|WHERE\s+[\w.]+\s*(?:[=<>!]|IN|LIKE|IS)|(?:LEFT\s+|INNER\s+|RIGHT\s+)?JOIN\s+\w+|GROUP\s+BY|ORDER\s+BY|HAVING\s+)",
        r"(?i)^select\s+\*\s+from\s+\w+",
        // Shell.
        r"^(?:\$|#)\s+\S+\s+-{1,2}\w",
        r"^(?:sudo\s+)?(?:npm|yarn|pnpm|pip3?|cargo|docker|kubectl|git|apt-get|apt|brew|helm|terraform)\s+(?:install|run|build|test|add|push|pull|commit|checkout|clone|apply|get|exec|logs|compose|init|mod|rebase|merge|describe|plan|up|down)\b.*(?:\s-{1,2}\w|[/~=.:]|$)",
        r"^(?:curl|wget|ssh|scp|tar|grep|sed|awk|chmod|chown|ls|rm|cp|mv|cat|echo|export|mkdir|cd|set)\s+(?:-{1,2}[\w-]+|[\w.-]*[/~$=][\S]*|\x22|[0-7]{3,4}\s|[\w-]+\.[A-Za-z0-9]{1,5}(?:\s|$))",
        r"^go\s+(?:build|test|run|mod|get|vet|install|generate)\s+\S*[./-]",
        // YAML keys and Makefile targets on their own line.
        r"^[a-z_][\w.-]*:$",
        // Diagnostics: tracebacks, compiler errors, stack frames.
        r"^Traceback \(most recent call last\):|^File \x22.+\x22, line [0-9]+|^at [\w$.<>]+\(.*\)$|^(?:[\w]+\.)*\w+(?:Error|Exception):|^error(?:\[E[0-9]+\])?:|^-->\s+\S+:[0-9]+:[0-9]+|^[0-9]+\s*\|\s|^\|$|^\|\s+\^+|^panicked at|^warning: unused",
        // Diff hunks.
        r"^@@ -[0-9]+(?:,[0-9]+)? \+[0-9]+(?:,[0-9]+)? @@|^[+-]\s*(?:let|const|var|def|fn|return|import|if|for)\b",
    ];
    RegexSet::new(patterns.iter().map(|p| format!("(?-u){p}"))).expect("built-in patterns compile")
});

// Lines ending like statements or blocks, arrows, optional chaining, paths
// and method chains: syntax that may sit anywhere in a line.
static CODE_LINE_ANYWHERE: LazyLock<BytesRegex> = LazyLock::new(|| {
    BytesRegex::new(r"(?-u)[)\]\w\x22']\s*;$|(?:\)|=>|->)\s*\{$|=>\s*\S|\)\s*=>|\?\.\w|::\w+\(|\w\.\w+\(.*\)\.\w+\(")
        .expect("built-in pattern compiles")
});

static CODE_PUNCTUATION: LazyLock<Regex> =
    LazyLock::new(|| re(r"[(){}\[\];=<>]|::|->|\.\w+\(|\w_\w|\$\w|~[0-9]|\+\+|--|&&|\|\||[!=<>]="));

static INLINE: LazyLock<Regex> = LazyLock::new(|| re(r"`([^`\n]{1,200})`"));

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(p: &str) -> CodeVerdict {
        classify_code(p)
    }

    #[test]
    fn fenced_blocks_confirm() {
        assert_eq!(verdict("```python\nx = 1\n```"), CodeVerdict::Confirmed);
        assert_eq!(verdict("~~~\nfoo(bar);\n~~~"), CodeVerdict::Confirmed);
        assert_eq!(
            verdict("look:\n```js\nalert(1)"),
            CodeVerdict::Confirmed,
            "unterminated"
        );
    }

    #[test]
    fn fence_edge_cases() {
        // Code in a block labelled as text is still read as code.
        let p = "```text\nlet a = 1;\nlet b = 2;\nlet c = a + b;\n```";
        assert_eq!(verdict(p), CodeVerdict::Confirmed, "{:?}", analyze(p));
        // An info string does not close a block.
        let p = "```\nDear Anna,\n```js\nthanks\n```";
        assert_eq!(verdict(p), CodeVerdict::None, "{:?}", analyze(p));
        assert_eq!(verdict("````\nfoo(1);\n````"), CodeVerdict::Confirmed);
    }

    #[test]
    fn prose_in_fences_does_not_confirm() {
        assert_eq!(
            verdict("```text\nDear Sir, thanks.\n```"),
            CodeVerdict::None
        );
        assert_eq!(
            verdict("```\nHello Anna, see you soon\n```"),
            CodeVerdict::None
        );
        assert_eq!(
            verdict("```\n```"),
            CodeVerdict::Unknown,
            "nothing but an empty fence"
        );
    }

    #[test]
    fn unfenced_clusters_confirm() {
        let p = "def f(x):\n    y = x * 2\n    return y\n";
        assert_eq!(verdict(p), CodeVerdict::Confirmed, "{:?}", analyze(p));
        let p = "let a = 1;\nlet b = a + 1;\n// sum\nconsole.log(a + b);";
        assert_eq!(verdict(p), CodeVerdict::Confirmed, "{:?}", analyze(p));
    }

    #[test]
    fn scattered_lines_do_not_confirm() {
        let p = "x = 1\nThe weather was fine that day and we walked.\nSome more words here.\nAnd more.\ny = 2\nEven more prose.\nStill prose.\nz = 3";
        assert_eq!(verdict(p), CodeVerdict::Unknown, "{:?}", analyze(p));
    }

    #[test]
    fn single_lines_are_unknown() {
        for p in [
            "x = foo(bar);",
            "print('hi')",
            "a => a + 1",
            "Why does `vec.len()` panic?",
        ] {
            assert_eq!(verdict(p), CodeVerdict::Unknown, "{p}: {:?}", analyze(p));
        }
    }

    #[test]
    fn prose_about_code_is_none() {
        for p in [
            "Write a function that sorts a list.",
            "If you have time, import the photos from the camera.",
            "For example: the class met on Monday.",
            "Return the book to the library by Friday.",
            "Select one option from the menu below.",
            "Make sure the oven is hot; then bake it.",
        ] {
            assert_eq!(verdict(p), CodeVerdict::None, "{p}: {:?}", analyze(p));
        }
    }

    #[test]
    fn early_stop_agrees_with_full_scan() {
        for p in [
            "a\n```py\nx = 1\n```\nmore",
            "let a = 1;\nlet b = 2;\nlet c = 3;\nprose",
            "prose only here",
            "x = 1",
            "",
        ] {
            assert_eq!(classify_code(p), analyze(p).verdict(), "{p:?}");
        }
    }

    #[test]
    fn blank_is_unknown() {
        assert_eq!(verdict(""), CodeVerdict::Unknown);
        assert_eq!(verdict("  \n\t"), CodeVerdict::Unknown);
    }

    #[test]
    fn other_languages() {
        for p in [
            "<?php\n$x = $_GET['x'];\necho $x;\n?>",
            "FROM alpine:3.20\nRUN apk add curl\nCMD [\"sh\"]",
            "(defn inc2 [x]\n  (+ x 2))\n(map inc2 [1 2 3])",
            "UPDATE t SET a = 1 WHERE b IS NULL;\nDELETE FROM t WHERE a = 2;\nSELECT a FROM t;",
        ] {
            assert_eq!(verdict(p), CodeVerdict::Confirmed, "{p}: {:?}", analyze(p));
        }
    }

    proptest::proptest! {
        /// The prefilter is only an optimisation: it must never hide a line
        /// that the full pattern set would accept.
        #[test]
        fn prefilter_is_a_necessary_condition(
            word in "(if|for|kind|SELECT|x|Note|the|[a-z]{1,8}|[A-Z]{2,6})",
            rest in "[a-zA-Z_ (){}\\[\\];=<>$#@|+*/&%^~:\"'.,!?-]{0,60}",
        ) {
            let line = format!("{word}{rest}");
            let line = line.trim();
            if !line.is_empty() && !may_be_code(line) {
                proptest::prop_assert!(!matches_code_pattern(line) && !minified(line), "{line:?}");
            }
        }
    }

    #[test]
    fn prefilter_accepts_every_code_line_in_the_corpus() {
        let corpus = include_str!("../tests/corpus/code.tsv");
        for line in corpus.lines().flat_map(|l| l.split("\\n")) {
            let line = line.trim();
            if !line.is_empty() && (matches_code_pattern(line) || minified(line)) {
                assert!(may_be_code(line), "{line:?}");
            }
        }
    }

    #[test]
    fn minified_line() {
        assert!(line_is_code(
            "function f(a){return a*2;} var x = f(3); console.log(x);"
        ));
        assert!(!line_is_code("We met; we talked; we left."));
    }

    #[test]
    fn clusters_tolerate_single_gaps() {
        let mut c = Cluster::default();
        for is_code in [true, false, true, true] {
            c.push(is_code);
        }
        assert_eq!(c.len, 3);
        c.push(false);
        c.push(false);
        assert_eq!(c.len, 0);
    }
}
