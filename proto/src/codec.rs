//! The codec of every service here: prost's, with small buffers.
//!
//! tonic's default encodes a stream's messages into one buffer until 32 KiB are pending,
//! and the stream keeps that buffer at its largest size for as long as it lives: after a
//! Watch snapshot, ~85 KiB per stream on the registrar, the bulk of its memory per agent
//! (heaptrack under the scale simulator, proposals/011). Writing each message as it comes
//! keeps a stream's buffer to its largest message (a snapshot chunk is a few KiB).

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Where a buffer starts, and how much is pending before a write: one message.
const BUFFER_BYTES: usize = 4 * 1024;

fn buffers() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, BUFFER_BYTES)
}

#[derive(Debug, Clone)]
pub struct SmallBuffers<T, U>(std::marker::PhantomData<(T, U)>);

impl<T, U> Default for SmallBuffers<T, U> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T, U> Codec for SmallBuffers<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(buffers())
    }
}
