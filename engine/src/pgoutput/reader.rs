//! A bounds-checked cursor over one message: every read says what it expected, so truncated or
//! hostile input becomes a [`DecodeError`] instead of a panic.

use super::DecodeError;

pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Which message is being read, for error messages.
    context: &'static str,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8], context: &'static str) -> Self {
        Reader {
            bytes,
            pos: 0,
            context,
        }
    }

    pub(super) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        DecodeError::Truncated {
            context: self.context,
            field,
            offset: self.pos,
            needed,
            available: self.remaining(),
        }
    }

    pub(super) fn take(
        &mut self,
        len: usize,
        field: &'static str,
    ) -> Result<&'a [u8], DecodeError> {
        if len > self.remaining() {
            return Err(self.truncated(field, len));
        }
        let start = self.pos;
        self.pos += len;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    pub(super) fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    pub(super) fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(field)?))
    }

    /// A NUL-terminated UTF-8 string (Postgres `String`), borrowed without its terminator.
    pub(super) fn cstr(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        let rest = &self.bytes[self.pos..];
        let Some(len) = rest.iter().position(|&b| b == 0) else {
            return Err(DecodeError::UnterminatedString {
                context: self.context,
                field,
                offset: self.pos,
            });
        };
        let text = std::str::from_utf8(&rest[..len]).map_err(|_| DecodeError::InvalidUtf8 {
            context: self.context,
            field,
            offset: self.pos,
        })?;
        self.pos += len + 1;
        Ok(text)
    }

    /// A count that announces `count` items of at least `min_item_len` bytes each; rejected
    /// before anything is allocated if the rest of the message cannot hold them.
    pub(super) fn count(
        &mut self,
        count: usize,
        min_item_len: usize,
        field: &'static str,
    ) -> Result<usize, DecodeError> {
        let needed = count.saturating_mul(min_item_len);
        if needed > self.remaining() {
            return Err(DecodeError::CountTooLarge {
                context: self.context,
                field,
                count,
                needed,
                available: self.remaining(),
            });
        }
        Ok(count)
    }

    /// Fails if bytes are left over: pgoutput messages have an exact length, so leftovers mean
    /// the stream speaks another protocol version than the one decoded.
    pub(super) fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(DecodeError::TrailingBytes {
                context: self.context,
                extra,
            }),
        }
    }
}
