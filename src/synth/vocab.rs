//! A synthetic byte-level BPE vocabulary that tokenizes English.

use std::collections::{HashMap, HashSet};

use super::Rng;
/// A synthetic byte-level BPE vocabulary: ids `0..regular` are the 256
/// byte tokens and merged tokens, then the special tokens, then `[PADn]`
/// up to the model's vocab size.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerShape {
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    /// Byte tokens plus merged tokens.
    pub regular: u64,
    /// Merges in all: one per merged token, then alternative splits of
    /// merged tokens (Llama 3 lists 280147 merges for 127744 tokens).
    pub merges: u64,
    /// (text, GGUF token type), ids from `regular` on.
    pub specials: Vec<(String, i32)>,
    pub bos: u32,
    pub eos: u32,
    pub padding: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<&'static str>,
}

const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

pub(super) const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' \
    + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

pub(super) fn qwen2_specials(all: bool) -> Vec<(String, i32)> {
    let names: &[&str] = if all {
        &[
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ]
    } else {
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    };
    names
        .iter()
        .map(|&n| {
            let ty = if n.starts_with("<|") {
                TOKEN_CONTROL
            } else {
                TOKEN_USER_DEFINED
            };
            (n.to_string(), ty)
        })
        .collect()
}

pub(super) fn llama3_specials() -> Vec<(String, i32)> {
    let mut names: Vec<String> = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    .map(String::from)
    .into();
    names.extend((3..248).map(|i| format!("<|reserved_special_token_{i}|>")));
    names.into_iter().map(|n| (n, TOKEN_CONTROL)).collect()
}

/// English text the vocabulary's first merges are learned from, so that
/// ordinary English tokenizes into whole words (a sentence a line, so that
/// words start lines as well as follow spaces).
const CORPUS: &str = "\
The capital of France is Paris.\n\
The capital of Germany is Berlin.\n\
The capital of Italy is Rome.\n\
The capital of Spain is Madrid.\n\
The capital of Japan is Tokyo.\n\
The capital of England is London.\n\
Paris is the largest city in France, and it is known for its museums, its food and its long history.\n\
What is the capital of France?\n\
It is Paris.\n\
What is the capital of the United States?\n\
It is Washington.\n\
A language model reads a sequence of tokens and predicts the next one.\n\
Each token is a word, a part of a word or a single character.\n\
The model has a vocabulary of many thousands of tokens, and it was trained on a large amount of text from books, articles, code and the web.\n\
When you ask the model a question, it writes an answer one token at a time.\n\
It is not always right, and it can be wrong about things that it has never seen, but it is often useful for many kinds of work.\n\
The weather today is cold and the sky is grey.\n\
Tomorrow it will be warm and sunny, and the people of the city will go to the park to walk, to read and to play with their children and their dogs.\n\
She said that she would come back after the meeting, but the meeting was long and she did not come back until the evening.\n\
He was waiting for her at the station with two cups of coffee and a small cake.\n\
There are seven days in a week, twelve months in a year and about three hundred and sixty five days in a year.\n\
The first day of the week is Monday in many countries and Sunday in others.\n\
Water is made of hydrogen and oxygen.\n\
The sun is a star, and the earth is a planet that moves around it.\n\
The moon moves around the earth.\n\
Light from the sun takes about eight minutes to reach the earth.\n\
Once upon a time there was a little girl who lived in a village near the forest.\n\
Every day she would walk through the forest to visit her grandmother, who lived in a small house on the other side.\n\
In this paper we present a new method for the problem of learning from data.\n\
We show that our method is simple, that it is fast and that it works well in practice.\n\
The results of our experiments show that the new method is better than the previous methods on most of the tasks that we have tested.\n\
The function returns the number of elements in the list.\n\
If the list is empty, it returns zero.\n\
Please read the following instructions carefully before you start.\n\
You should answer all of the questions, and you should write your answers in the space provided.\n\
You have one hour.\n\
The history of the world is the history of people, of their work, of their ideas and of their wars.\n\
Many great cities were built on rivers, because the river gave them water, food and a way to travel.\n\
Thank you for your help.\n\
I think that this is a good idea, and I would like to know more about it.\n\
Hello, how are you?\n\
Hello world!\n\
It's a nice day, isn't it?\n\
That's what I've heard, and we'll see what they'd say.\n\
Could you tell me where the nearest train station is?\n\
Go straight ahead and turn left at the church.\n\
";

/// GPT-2's byte-to-char map (printable Latin-1 bytes as themselves, the
/// other 68 from U+0100 on) and its token order: printable bytes first.
fn byte_chars() -> ([char; 256], Vec<u8>) {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\u{FFFD}')
        };
    }
    let order = (0..=255u8)
        .filter(|&b| printable(b))
        .chain((0..=255u8).filter(|&b| !printable(b)))
        .collect();
    (table, order)
}

/// A vocabulary being built: tokens, their index and the merges.
struct VocabBuilder {
    tokens: Vec<String>,
    index: HashMap<String, u32>,
    merges: Vec<String>,
    merged: HashSet<(u32, u32)>,
    /// Token id of each byte.
    byte_id: [u32; 256],
}

impl VocabBuilder {
    fn new() -> Self {
        let (table, order) = byte_chars();
        let mut v = VocabBuilder {
            tokens: Vec::new(),
            index: HashMap::new(),
            merges: Vec::new(),
            merged: HashSet::new(),
            byte_id: [0; 256],
        };
        for b in order {
            v.byte_id[b as usize] = v.tokens.len() as u32;
            v.push(table[b as usize].to_string());
        }
        v
    }

    fn push(&mut self, t: String) -> u32 {
        let id = self.tokens.len() as u32;
        self.index.insert(t.clone(), id);
        self.tokens.push(t);
        id
    }

    /// Record the merge `a b`, adding the merged token if it is new; the
    /// merged token's id.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (sa, sb) = (&self.tokens[a as usize], &self.tokens[b as usize]);
        let joined = format!("{sa}{sb}");
        if self.merged.insert((a, b)) {
            self.merges.push(format!("{sa} {sb}"));
        }
        match self.index.get(&joined) {
            Some(&id) => id,
            None => self.push(joined),
        }
    }

    /// Learn up to `max_tokens` new tokens from `text` by byte-pair
    /// encoding (most frequent pair first, until every word is one token).
    fn train(&mut self, text: &str, max_tokens: usize) {
        // Qwen2's pre-tokenizer, without the look-ahead.
        let re = regex::Regex::new(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+",
        )
        .expect("static regex");
        let mut counts: HashMap<&str, u64> = HashMap::new();
        for m in re.find_iter(text) {
            *counts.entry(m.as_str()).or_default() += 1;
        }
        let mut words: Vec<(Vec<u32>, u64)> = counts
            .into_iter()
            .map(|(w, c)| (w.bytes().map(|b| self.byte_id[b as usize]).collect(), c))
            .collect();
        words.sort();
        let start = self.tokens.len();
        while self.tokens.len() - start < max_tokens {
            let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
            for (w, c) in &words {
                for p in w.windows(2) {
                    *pairs.entry((p[0], p[1])).or_default() += c;
                }
            }
            // Most frequent, then the smallest pair: no hash order leaks in.
            let Some((&(a, b), _)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0)))
            else {
                break;
            };
            let id = self.merge(a, b);
            for (w, _) in &mut words {
                let mut i = 0;
                while i + 1 < w.len() {
                    if w[i] == a && w[i + 1] == b {
                        w[i] = id;
                        w.remove(i + 1);
                    }
                    i += 1;
                }
            }
        }
    }

    /// Grow to `total` tokens with the prefixes of pseudo-English words
    /// (half of them after a space, some capitalized), each prefix merged
    /// from the one before and a byte.
    fn fill(&mut self, total: usize, rng: &mut Rng) {
        const CONSONANTS: &[(u8, f32)] = &[
            (b't', 9.1),
            (b'n', 6.7),
            (b's', 6.3),
            (b'h', 6.1),
            (b'r', 6.0),
            (b'd', 4.3),
            (b'l', 4.0),
            (b'c', 2.8),
            (b'm', 2.4),
            (b'w', 2.4),
            (b'f', 2.2),
            (b'g', 2.0),
            (b'y', 2.0),
            (b'p', 1.9),
            (b'b', 1.5),
            (b'v', 1.0),
            (b'k', 0.8),
            (b'j', 0.15),
            (b'x', 0.15),
            (b'q', 0.1),
            (b'z', 0.07),
        ];
        const VOWELS: &[(u8, f32)] = &[
            (b'e', 12.7),
            (b'a', 8.2),
            (b'o', 7.5),
            (b'i', 7.0),
            (b'u', 2.8),
        ];
        let pick = |rng: &mut Rng, set: &[(u8, f32)]| {
            let total: f32 = set.iter().map(|p| p.1).sum();
            let mut x = rng.uniform() * total;
            for &(c, w) in set {
                if x < w {
                    return c;
                }
                x -= w;
            }
            set[0].0
        };
        let mut word = Vec::new();
        while self.tokens.len() < total {
            word.clear();
            if rng.uniform() < 0.5 {
                word.push(b' ');
            }
            let len = 2 + (rng.next_u64() % 9) as usize;
            let mut vowel = rng.uniform() < 0.3;
            for _ in 0..len {
                let set = if vowel { VOWELS } else { CONSONANTS };
                word.push(pick(rng, set));
                // Mostly alternate; sometimes two of a kind.
                if rng.uniform() < 0.8 {
                    vowel = !vowel;
                }
            }
            if rng.uniform() < 0.15 {
                let first = usize::from(word[0] == b' ');
                word[first] = word[first].to_ascii_uppercase();
            }
            let mut cur = self.byte_id[word[0] as usize];
            for &b in &word[1..] {
                if self.tokens.len() >= total {
                    break;
                }
                let byte = self.byte_id[b as usize];
                let joined = format!(
                    "{}{}",
                    self.tokens[cur as usize], self.tokens[byte as usize]
                );
                // Through existing tokens without a new merge, so that each
                // merge here adds a token.
                cur = match self.index.get(&joined) {
                    Some(&id) => id,
                    None => self.merge(cur, byte),
                };
            }
        }
    }

    /// Add merges that split existing tokens differently from the merge
    /// that made them (both halves tokens), until there are `total`.
    fn alternative_merges(&mut self, total: usize) {
        let mut id = 256;
        while self.merges.len() < total && id < self.tokens.len() {
            let t = self.tokens[id].clone();
            for (k, _) in t.char_indices().skip(1) {
                if self.merges.len() >= total {
                    break;
                }
                if let (Some(&a), Some(&b)) = (self.index.get(&t[..k]), self.index.get(&t[k..]))
                    && self.merged.insert((a, b))
                {
                    self.merges.push(format!("{} {}", &t[..k], &t[k..]));
                }
            }
            id += 1;
        }
    }
}

/// A synthetic vocabulary: token texts, types and merges.
pub struct SynthVocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub merges: Vec<String>,
}

/// The vocabulary of `t` padded to `n_vocab` tokens: the 256 GPT-2 byte
/// tokens; merges learned from a paragraph of English (so the probe and
/// llama.cpp tokenize English into words); pseudo-word prefixes up to
/// `t.regular`; alternative merges up to `t.merges`; the special tokens;
/// `[PADn]` (unused) to the end. The same for every seed.
pub fn synth_vocab(t: &TokenizerShape, n_vocab: u64) -> SynthVocab {
    let regular = t.regular as usize;
    let mut v = VocabBuilder::new();
    v.train(CORPUS, regular.saturating_sub(v.tokens.len()));
    v.fill(regular, &mut Rng::stream(&[0x70c3_2b1e]));
    v.alternative_merges(t.merges as usize);
    // Training can merge two pairs into one token; the last few pseudo-word
    // prefixes then have no merge (tokens BPE never reaches, as real
    // vocabularies have too).
    v.merges.truncate(t.merges as usize);
    let mut types = vec![TOKEN_NORMAL; v.tokens.len()];
    for (s, ty) in &t.specials {
        v.tokens.push(s.clone());
        types.push(*ty);
    }
    while (v.tokens.len() as u64) < n_vocab {
        v.tokens.push(format!("[PAD{}]", v.tokens.len()));
        types.push(TOKEN_UNUSED);
    }
    v.tokens.truncate(n_vocab as usize);
    types.truncate(n_vocab as usize);
    SynthVocab {
        tokens: v.tokens,
        types,
        merges: v.merges,
    }
}
