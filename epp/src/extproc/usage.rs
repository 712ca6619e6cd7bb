//! The token counts an OpenAI-compatible server reports in its answer
//! (`usage.prompt_tokens`, `usage.prompt_tokens_details.cached_tokens`;
//! the Responses API says `input_tokens` and `input_tokens_details`), read
//! off the response body as it streams past, in constant memory.
//!
//! A streamed answer reports usage in its last event (vLLM with
//! `stream_options.include_usage`), a whole one at its end: the scanner
//! keeps the last value of each key it sees. It does not parse the JSON,
//! which may be megabytes of generated text; a key spelt inside generated
//! text is escaped (`\"prompt_tokens\"`), so it cannot match.

use memchr::memmem;

/// What the server reported; either may be missing (vLLM reports cached
/// tokens only with `--enable-prompt-tokens-details`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

const PROMPT: &[u8] = br#""prompt_tokens""#;
const INPUT: &[u8] = br#""input_tokens""#;
const CACHED: &[u8] = br#""cached_tokens""#;

/// Bytes carried from one chunk to the next, so that a key and its number
/// split across chunks are still read: a key, a colon with some spaces,
/// and 20 digits fit.
const CARRY: usize = 64;

#[derive(Debug, Default)]
pub(crate) struct UsageScanner {
    /// The previous chunk's last bytes, then the current chunk.
    window: Vec<u8>,
    usage: Usage,
}

impl UsageScanner {
    /// Reads one chunk; `last`: the body ends with it.
    pub(crate) fn feed(&mut self, chunk: &[u8], last: bool) {
        self.window.extend_from_slice(chunk);
        if let Some(n) = last_number_after(&self.window, PROMPT, last)
            .or_else(|| last_number_after(&self.window, INPUT, last))
        {
            self.usage.prompt_tokens = Some(n);
        }
        if let Some(n) = last_number_after(&self.window, CACHED, last) {
            self.usage.cached_tokens = Some(n);
        }
        let keep = self.window.len().min(CARRY);
        self.window.drain(..self.window.len() - keep);
    }

    pub fn usage(&self) -> Usage {
        self.usage
    }
}

/// The number after the last complete `key: <digits>` in `text`. Digits
/// that run to the end of `text` may continue in the next chunk: they count
/// only when `text` is the body's end.
fn last_number_after(text: &[u8], key: &[u8], at_end: bool) -> Option<u64> {
    memmem::rfind_iter(text, key).find_map(|at| {
        let rest = &text[at + key.len()..];
        let rest = rest
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || digits > 19 || (digits == rest.len() && !at_end) {
            return None;
        }
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Usage {
        let mut s = UsageScanner::default();
        for (i, c) in chunks.iter().enumerate() {
            s.feed(c, i + 1 == chunks.len());
        }
        s.usage()
    }

    const WHOLE: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"say \"prompt_tokens\": 9"}}],"usage":{"prompt_tokens":1234,"total_tokens":1240,"completion_tokens":6,"prompt_tokens_details":{"cached_tokens":1024}}}"#;

    #[test]
    fn a_whole_answer_reports_both_counts_and_quoted_text_does_not_count() {
        let usage = scan(&[WHOLE]);
        assert_eq!(usage.prompt_tokens, Some(1234));
        assert_eq!(usage.cached_tokens, Some(1024));
    }

    #[test]
    fn counts_split_anywhere_across_chunks_are_read_whole() {
        for cut in 1..WHOLE.len() {
            let usage = scan(&[&WHOLE[..cut], &WHOLE[cut..]]);
            assert_eq!(usage.prompt_tokens, Some(1234), "cut at {cut}");
            assert_eq!(usage.cached_tokens, Some(1024), "cut at {cut}");
        }
    }

    #[test]
    fn a_stream_reports_usage_in_its_last_event() {
        let usage = scan(&[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\": 77, \"prompt_tokens_details\": {\"cached_tokens\": 64}}}\n\n",
            b"data: [DONE]\n\n",
        ]);
        assert_eq!(usage.prompt_tokens, Some(77));
        assert_eq!(usage.cached_tokens, Some(64));
    }

    #[test]
    fn a_responses_stream_reports_input_tokens_when_it_completes() {
        let usage = scan(&[
            b"event: response.created\ndata: {\"response\":{\"usage\":null}}\n\n",
            b"event: response.completed\ndata: {\"response\":{\"output\":[],\"usage\":{\"input_tokens\":300,\"input_tokens_details\":{\"cached_tokens\":256},\"output_tokens\":4}}}\n\n",
        ]);
        assert_eq!(usage.prompt_tokens, Some(300));
        assert_eq!(usage.cached_tokens, Some(256));
    }

    #[test]
    fn missing_null_or_absurd_counts_are_none() {
        let usage = scan(&[br#"{"usage":{"prompt_tokens":null,"prompt_tokens_details":null}}"#]);
        assert_eq!(usage, Usage::default());
        let usage = scan(&[br#"{"usage":{"prompt_tokens":99999999999999999999999}}"#]);
        assert_eq!(usage.prompt_tokens, None);
        // Digits at a chunk's end wait for the next chunk.
        let mut s = UsageScanner::default();
        s.feed(br#"{"usage":{"prompt_tokens":12"#, false);
        assert_eq!(s.usage().prompt_tokens, None);
        s.feed(b"3}}", true);
        assert_eq!(s.usage().prompt_tokens, Some(123));
    }

    #[test]
    fn memory_stays_bounded_however_long_the_body() {
        let mut s = UsageScanner::default();
        for _ in 0..1000 {
            s.feed(&[b'x'; 4096], false);
            assert!(s.window.capacity() <= 2 * (4096 + CARRY));
        }
    }
}
