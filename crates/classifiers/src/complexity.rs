//! Prompt complexity from cheap lexical features.
//!
//! The goal is routing, not grading: `low` prompts can go to a small model
//! without visible loss, `high` prompts need a strong reasoning model. The
//! score is a sum of small integer contributions so that every decision can be
//! explained by looking at [`Features`], and so that it is deterministic across
//! platforms (no floating point in the decision).

use std::sync::LazyLock;

use std::collections::HashMap;

use regex::Regex;

use crate::code::{CodeVerdict, classify_code};

/// Every tag the complexity classifier can emit.
pub const TAGS: &[&str] = &["complexity-low", "complexity-medium", "complexity-high"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Low,
    Medium,
    High,
}

impl Level {
    pub fn tag(self) -> &'static str {
        match self {
            Level::Low => "complexity-low",
            Level::Medium => "complexity-medium",
            Level::High => "complexity-high",
        }
    }
}

/// Scores at or above this are `medium`.
pub const MEDIUM_FROM: u32 = 2;
/// Scores at or above this are `high`.
pub const HIGH_FROM: u32 = 6;

/// The measurements the score is computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Features {
    /// Whitespace-separated tokens.
    pub words: usize,
    pub questions: usize,
    /// Lines that start a numbered or bulleted item.
    pub list_items: usize,
    /// Inline sub-question markers such as `(a)`, `(b)`.
    pub parts: usize,
    /// Distinct reasoning cues ("prove", "trade-offs", "step by step", ...).
    ///
    /// Cue counts (this and the four below) are exact until every one of them
    /// reaches the cap [`Features::score`] applies; the scan stops there,
    /// because no further cue could change the score.
    pub reasoning: usize,
    /// Distinct task cues that ask for produced content ("write", "explain").
    pub tasks: usize,
    /// Instructions chained after the first one (", then explain", "and list").
    pub chained_instructions: usize,
    /// Requirement phrases ("must", "without", "at least", ...).
    pub constraints: usize,
    /// Distinct mathematical cues (LaTeX, math symbols, math vocabulary).
    pub math: usize,
    /// The code classifier confirmed code in the prompt.
    pub code: bool,
}

impl Features {
    /// The contributions, kept as named terms so tests and tools can explain a
    /// decision.
    pub fn score(&self) -> u32 {
        let length = match self.words {
            0..8 => 0,
            8..25 => 1,
            25..60 => 2,
            60..150 => 3,
            150..400 => 4,
            _ => 5,
        };
        let capped = |n: usize, cap: u32| u32::try_from(n).unwrap_or(u32::MAX).min(cap);
        let reasoning = 2 * capped(self.reasoning, 4);
        let tasks = capped(self.tasks, 2);
        let questions = u32::from(self.questions >= 2) + u32::from(self.questions >= 4);
        let structure = if self.list_items >= 3 || self.parts >= 3 {
            2
        } else {
            u32::from(self.list_items >= 2 || self.parts >= 2)
        };
        let chained =
            u32::from(self.chained_instructions >= 2) + u32::from(self.chained_instructions >= 3);
        let constraints = u32::from(self.constraints >= 3) + u32::from(self.constraints >= 6);
        let math = u32::from(self.math >= 1) + u32::from(self.math >= 3);
        let code = u32::from(self.code);
        length + reasoning + tasks + questions + structure + chained + constraints + math + code
    }

    pub fn level(&self) -> Level {
        match self.score() {
            s if s >= HIGH_FROM => Level::High,
            s if s >= MEDIUM_FROM => Level::Medium,
            _ => Level::Low,
        }
    }
}

/// Measures the prompt. Linear in its length: one pass of a literal
/// multi-pattern search over a lower-cased copy finds every cue at once.
pub fn features(prompt: &str) -> Features {
    let lower = prompt.to_ascii_lowercase();
    let cues = scan_cues(&lower);
    Features {
        words: count_words(prompt),
        questions: prompt.bytes().filter(|&b| b == b'?').count(),
        list_items: prompt.lines().filter(|l| is_list_item(l)).count(),
        parts: distinct_parts(prompt),
        reasoning: cues.reasoning.count_ones() as usize,
        tasks: cues.tasks.count_ones() as usize,
        chained_instructions: cues.chained.min(16),
        constraints: cues.constraints.min(16),
        math: (cues.math | symbolic_math(prompt)).count_ones() as usize,
        code: classify_code(prompt) == CodeVerdict::Confirmed,
    }
}

/// Blank prompts are `low`: there is nothing to reason about.
pub fn classify_complexity(prompt: &str) -> Level {
    features(prompt).level()
}

/// Whitespace-separated tokens. Written as a count of token starts over byte
/// pairs, with no state carried between iterations, so it compiles to a
/// vectorised loop.
fn count_words(prompt: &str) -> usize {
    let b = prompt.as_bytes();
    let first = usize::from(b.first().is_some_and(|c| !c.is_ascii_whitespace()));
    first
        + b.windows(2)
            .filter(|w| w[0].is_ascii_whitespace() & !w[1].is_ascii_whitespace())
            .count()
}

/// `1. step`, `- item`, `* item`, `• item`, `(a) part`, `a) part`.
fn is_list_item(line: &str) -> bool {
    let t = line.trim_start_matches([' ', '\t']);
    let rest = if let Some(r) = t.strip_prefix(['-', '*']).or_else(|| t.strip_prefix('•')) {
        r
    } else {
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        let b = t.as_bytes();
        if (1..=2).contains(&digits) && matches!(b.get(digits), Some(b'.' | b')')) {
            &t[digits + 1..]
        } else if b.len() >= 3 && b[0] == b'(' && (b'a'..=b'h').contains(&b[1]) && b[2] == b')' {
            &t[3..]
        } else if b.len() >= 2 && (b'a'..=b'h').contains(&b[0]) && b[1] == b')' {
            &t[2..]
        } else {
            return false;
        }
    };
    rest.starts_with([' ', '\t']) && !rest.trim().is_empty()
}

/// Distinct `(a)`..`(h)` markers standing alone between blanks.
fn distinct_parts(prompt: &str) -> usize {
    let b = prompt.as_bytes();
    let mut seen = [false; 8];
    for (i, _) in prompt.match_indices('(') {
        let standalone = (i == 0 || b[i - 1].is_ascii_whitespace())
            && b.get(i + 2) == Some(&b')')
            && b.get(i + 3).is_some_and(u8::is_ascii_whitespace);
        if let Some(&letter) = b.get(i + 1).filter(|_| standalone) {
            let letter = letter.to_ascii_lowercase();
            if (b'a'..=b'h').contains(&letter) {
                seen[usize::from(letter - b'a')] = true;
            }
        }
    }
    seen.iter().filter(|&&s| s).count()
}

#[derive(Default)]
struct Cues {
    /// Bit i set when reasoning cue group i occurs.
    reasoning: u64,
    tasks: u64,
    math: u64,
    chained: usize,
    constraints: usize,
}

impl Cues {
    /// Every cue count is at or above the cap applied in [`Features::score`].
    fn saturated(&self) -> bool {
        self.reasoning.count_ones() >= 4
            && self.tasks.count_ones() >= 2
            && self.math.count_ones() >= 3
            && self.chained >= 3
            && self.constraints >= 6
    }
}

#[derive(Clone, Copy)]
enum Role {
    Reasoning(u8),
    Task(u8),
    Math(u8),
    Constraint,
    Verb,
}

/// A cue as written in the tables: a trailing `*` makes it a stem that may be
/// followed by more letters ("optimi*" matches "optimize", "optimisation").
struct Variant {
    role: Role,
    stem: bool,
}

// Cue groups: each inner slice is one cue, counted once however often and in
// whichever variant it appears, because repetition is not difficulty.
const REASONING: &[&[&str]] = &[
    &["prove", "proves", "proving", "proof", "proofs"],
    &["derive", "derives", "deriving", "derivation*"],
    &["rigorous*"],
    &[
        "formalize",
        "formalise",
        "formal logic",
        "first-order logic",
    ],
    &["theorem*", "lemma*"],
    &["step by step", "step-by-step"],
    &[
        "analyze",
        "analyse",
        "analyzing",
        "analysing",
        "analysis",
        "analyses",
    ],
    &["design", "designing"],
    &["architect*"],
    &["compare", "comparing", "comparison*"],
    &["contrast*"],
    &["trade-off*", "tradeoff*", "trade off*"],
    &["evaluate", "evaluating", "evaluation*"],
    &["critique*", "critici*"],
    &["justify", "justified", "justification*"],
    &["optimi*"],
    &["complexity"],
    &["algorithm*"],
    &["invariant*", "correctness"],
    &["edge case*"],
    &["failure mode*"],
    &["strategy", "strategies"],
    &["mitigat*"],
    &["distributed"],
    &[
        "concurren*",
        "thread-safe",
        "race condition*",
        "data race*",
        "lock-free",
        "memory model",
        "memory ordering",
    ],
    &["consistency", "consistent hashing"],
    &["scalab*", "shard*"],
    &["benchmark*"],
    &["hypothes*"],
    &[
        "confounder*",
        "statistical*",
        "power analysis",
        "randomi*",
        "sample size",
        "experiment*",
    ],
    &["pros and cons"],
    &["first principles"],
    &["implications"],
    &["hidden premise*", "fallac*"],
    &["show that", "generalize", "generalise"],
    &[
        "root cause*",
        "investigat*",
        "diagnos*",
        "remediat*",
        "troubleshoot*",
    ],
    &["assumption*"],
    &["choice between", "choose between", "which is better"],
];

// Cues that the prompt asks for produced content rather than a lookup.
const TASKS: &[&[&str]] = &[
    &["explain*"],
    &["write", "writing", "draft*", "compose"],
    &["create", "creating"],
    &["summarize", "summarise", "summary"],
    &["describe"],
    &["rewrite", "refactor*", "proofread*"],
    &["implement*"],
    &["plan", "outline*", "itinerary"],
    &["difference between", "differences between"],
    &["how do", "how does", "how can", "how should", "how would"],
    &["why", "cause", "caused"],
    &[
        "debug*",
        "fix this code",
        "fix the code",
        "fix my code",
        "fix this bug",
        "fix the bug",
        "fix this error",
        "fix the error",
    ],
    &["recommend*", "suggest*"],
];

const MATH_WORDS: &[&[&str]] = &[
    &[
        "integral*",
        "derivative*",
        "eigen*",
        "matrix",
        "matrices",
        "determinant*",
        "polynomial*",
        "differential equation*",
    ],
    &[
        "probability",
        "variance",
        "expected value",
        "random variable*",
        "distribution*",
    ],
    &[
        "modulo",
        "prime",
        "primes",
        "composite",
        "divisib*",
        "integer*",
    ],
    &[
        "sqrt",
        "converge*",
        "limit",
        "limits",
        "sequence*",
        "series",
    ],
];

/// Math cue ids beyond the word groups, found by [`symbolic_math`].
const MATH_LATEX: u8 = 4;
const MATH_SYMBOLS: u8 = 5;
const MATH_POWER: u8 = 6;
const MATH_SUBSCRIPT: u8 = 7;

const CONSTRAINTS: &[&str] = &[
    "must",
    "should",
    "without",
    "at least",
    "at most",
    "no more than",
    "ensure",
    "make sure",
    "handle",
    "including",
    "avoid",
    "exactly",
    "only",
    "each",
    "every",
    "per",
];

// An imperative verb right after a clause boundary is one more thing the
// answer must do.
const VERBS: &[&str] = &[
    "explain",
    "describe",
    "list",
    "propose",
    "compare",
    "analyze",
    "analyse",
    "design",
    "prove",
    "derive",
    "estimate",
    "justify",
    "recommend",
    "discuss",
    "identify",
    "evaluate",
    "write",
    "show",
    "find",
    "compute",
    "build",
    "rank",
    "enumerate",
    "verify",
    "summarize",
    "summarise",
    "outline",
    "suggest",
    "define",
    "plan",
    "diagnose",
    "implement",
    "test",
    "benchmark",
];

struct CueTable {
    search: Regex,
    roles: HashMap<&'static str, Vec<Variant>>,
}

/// Compiles every pattern of this module now rather than on first use.
pub(crate) fn warm_up() {
    LazyLock::force(&CUES);
    LazyLock::force(&LATEX);
    LazyLock::force(&POWER);
    LazyLock::force(&SUBSCRIPT);
}

static CUES: LazyLock<CueTable> = LazyLock::new(|| {
    let mut roles: HashMap<&'static str, Vec<Variant>> = HashMap::new();
    let mut add = |variant: &'static str, role: Role| {
        let (word, stem) = match variant.strip_suffix('*') {
            Some(w) => (w, true),
            None => (variant, false),
        };
        roles.entry(word).or_default().push(Variant { role, stem });
    };
    for (i, group) in REASONING.iter().enumerate() {
        group.iter().for_each(|v| add(v, Role::Reasoning(i as u8)));
    }
    for (i, group) in TASKS.iter().enumerate() {
        group.iter().for_each(|v| add(v, Role::Task(i as u8)));
    }
    for (i, group) in MATH_WORDS.iter().enumerate() {
        group.iter().for_each(|v| add(v, Role::Math(i as u8)));
    }
    CONSTRAINTS.iter().for_each(|v| add(v, Role::Constraint));
    VERBS.iter().for_each(|v| add(v, Role::Verb));
    // Longest first: the alternation is leftmost-first, and "how does" must
    // win over "how do".
    let mut words: Vec<&str> = roles.keys().copied().collect();
    words.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    let pattern = words
        .iter()
        .map(|w| regex::escape(w))
        .collect::<Vec<_>>()
        .join("|");
    CueTable {
        search: Regex::new(&pattern).expect("literal alternation compiles"),
        roles,
    }
});

fn scan_cues(lower: &str) -> Cues {
    let b = lower.as_bytes();
    let mut cues = Cues::default();
    for m in CUES.search.find_iter(lower) {
        if cues.saturated() {
            break;
        }
        if m.start() > 0 && b[m.start() - 1].is_ascii_alphanumeric() {
            continue;
        }
        let word_end = b.get(m.end()).is_none_or(|c| !c.is_ascii_alphabetic());
        for variant in CUES.roles.get(m.as_str()).into_iter().flatten() {
            if !variant.stem && !word_end {
                continue;
            }
            match variant.role {
                Role::Reasoning(i) => cues.reasoning |= 1 << i,
                Role::Task(i) => cues.tasks |= 1 << i,
                Role::Math(i) => cues.math |= 1 << i,
                Role::Constraint => cues.constraints += 1,
                Role::Verb => cues.chained += usize::from(follows_clause_boundary(b, m.start())),
            }
        }
    }
    cues
}

/// Whether the word at `start` opens a new clause: after `,;:.` or after
/// "and"/"then", possibly with "also" in between.
fn follows_clause_boundary(b: &[u8], start: usize) -> bool {
    let skip_blanks = |mut i: usize| {
        while i > 0 && b[i - 1].is_ascii_whitespace() {
            i -= 1;
        }
        i
    };
    let word_before = |end: usize| {
        let mut s = end;
        while s > 0 && b[s - 1].is_ascii_alphabetic() {
            s -= 1;
        }
        &b[s..end]
    };
    let mut i = skip_blanks(start);
    if i == start {
        return false;
    }
    if word_before(i) == b"also" {
        i = skip_blanks(i - 4);
    }
    i > 0
        && (matches!(b[i - 1], b',' | b';' | b':' | b'.')
            || matches!(word_before(i), b"and" | b"then"))
}

/// Math written with symbols rather than words, as bits at the `MATH_*` ids.
/// Each check is gated on a byte that must be present, so ordinary prose pays
/// only for a few fast scans.
fn symbolic_math(prompt: &str) -> u64 {
    let mut bits = 0u64;
    if prompt.contains('\\') && LATEX.is_match(prompt) {
        bits |= 1 << MATH_LATEX;
    }
    // All of these live in U+2200..U+22FF, whose UTF-8 starts E2 88 or E2 89.
    // Chunks are tested with a branch-free fold, which vectorises; only the
    // rare chunks holding E2 get the exact pair check.
    let b = prompt.as_bytes();
    let math_block = b.chunks(64).enumerate().any(|(n, chunk)| {
        chunk.iter().fold(false, |acc, &c| acc | (c == 0xE2))
            && b[n * 64..]
                .windows(2)
                .take(chunk.len())
                .any(|w| w[0] == 0xE2 && (w[1] == 0x88 || w[1] == 0x89))
    });
    if math_block
        && prompt.contains([
            '∫', '∑', '∏', '√', '∂', '∞', '≤', '≥', '≠', '≈', '∈', '∀', '∃',
        ])
    {
        bits |= 1 << MATH_SYMBOLS;
    }
    if prompt.contains('^') && POWER.is_match(prompt) {
        bits |= 1 << MATH_POWER;
    }
    if prompt.contains('_') && SUBSCRIPT.is_match(prompt) {
        bits |= 1 << MATH_SUBSCRIPT;
    }
    bits
}

static LATEX: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\\(?:frac|int|sum|prod|sqrt|lim|partial|infty|begin\{|mathbb|cdot|alpha|beta|theta|lambda)")
        .expect("built-in pattern compiles")
});

static POWER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[a-z0-9)]\^[0-9a-z({]").expect("built-in pattern compiles"));

static SUBSCRIPT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"[a-z]_\{|(?-u:\b)[a-z]_(?:[0-9]|n|i|k)(?-u:\b)")
        .expect("built-in pattern compiles")
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_lookups_are_low() {
        for p in [
            "",
            "hi",
            "What is the capital of France?",
            "Translate 'cat' to German.",
            "thanks!",
        ] {
            assert_eq!(classify_complexity(p), Level::Low, "{p}");
        }
    }

    #[test]
    fn single_tasks_are_medium() {
        for p in [
            "Explain how DNS resolution works for a web browser.",
            "Write a haiku about autumn leaves falling into a quiet river at dusk.",
            "What are the differences between a list and a tuple in Python?",
        ] {
            assert_eq!(
                classify_complexity(p),
                Level::Medium,
                "{p}: {:?}",
                features(p)
            );
        }
    }

    #[test]
    fn reasoning_heavy_prompts_are_high() {
        for p in [
            "Prove that the square root of 2 is irrational, step by step, with a rigorous argument.",
            "Design a sharded key-value store, compare leader-based and leaderless replication, and analyze the consistency trade-offs.",
        ] {
            assert_eq!(
                classify_complexity(p),
                Level::High,
                "{p}: {:?}",
                features(p)
            );
        }
    }

    #[test]
    fn repetition_does_not_inflate_reasoning() {
        let once = features("prove it");
        let many = features(&"prove it ".repeat(50));
        assert_eq!(once.reasoning, many.reasoning);
    }

    #[test]
    fn structure_counts() {
        let f = features("Do these:\n1. first\n2. second\n- third\nAnswer (a) x (b) y (c) z ");
        assert_eq!(f.list_items, 3);
        assert_eq!(f.parts, 3);
        assert_eq!(features("f(a) + g(b)").parts, 0);
    }

    #[test]
    fn chained_instructions() {
        let f = features(
            "Read it, then summarize the plot, list the characters and explain the ending.",
        );
        assert_eq!(f.chained_instructions, 3);
        assert_eq!(features("I like tea and biscuits.").chained_instructions, 0);
        assert_eq!(
            features("do it then explain, also list them").chained_instructions,
            2
        );
        assert_eq!(features("the band explain").chained_instructions, 0);
    }

    #[test]
    fn cue_words_need_word_boundaries() {
        assert_eq!(features("proofread this").reasoning, 0);
        assert_eq!(features("a planet").tasks, 0);
        assert_eq!(
            features("optimisation").reasoning,
            1,
            "stems match longer words"
        );
        assert_eq!(features("primary school").math, 0);
    }

    #[test]
    fn math_cues() {
        assert!(features(r"\frac{1}{2} + x^2").math >= 2);
        assert!(features("∫ f(x) dx with a_n").math >= 2);
        assert_eq!(features("see you at 5").math, 0);
    }

    #[test]
    fn deterministic() {
        let p = "Compare quicksort and mergesort, analyze their complexity.";
        assert_eq!(features(p), features(p));
        assert_eq!(classify_complexity(p), classify_complexity(p));
    }

    #[test]
    fn long_prompts_are_at_least_medium() {
        let p = "The quick brown fox jumps over the lazy dog. ".repeat(100);
        assert!(classify_complexity(&p) >= Level::Medium);
    }
}
