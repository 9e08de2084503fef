/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import java.nio.ByteBuffer;

/**
 * Receives the outcome of one {@link NativeBridge#fetchBlocks} call, one call per requested
 * block index (exactly one of {@link #onBlock} or {@link #onFailure} per index).
 *
 * <p>Threading: the native engine calls these from its own (attached, daemon) threads, possibly
 * several at once for different indices. Implementations must be thread-safe and must not
 * block for long: they run on the engine's progress threads.
 */
public interface FetchCallback {
  /**
   * A block arrived.
   *
   * @param index the position of the block in the arrays passed to {@code fetchBlocks}
   * @param directBuf a direct ByteBuffer over native, pooled memory holding exactly the block's
   *     bytes (position 0, limit = block length). It stays valid until
   *     {@link NativeBridge#releaseLease} is called with {@code leaseHandle}, and not a moment
   *     longer: the memory goes back to the engine's pool then.
   * @param leaseHandle the lease to release exactly once when the bytes are no longer needed
   */
  void onBlock(int index, ByteBuffer directBuf, long leaseHandle);

  /**
   * A block could not be fetched.
   *
   * @param index the position of the block in the arrays passed to {@code fetchBlocks}
   * @param kind the error kind (see {@link RdmaShuffleException})
   * @param message what failed, naming the peer and the block
   */
  void onFailure(int index, String kind, String message);

  /**
   * A block streamed into its file ({@link NativeBridge#fetchBlockToFile}) is complete.
   *
   * @param index always 0 (one block per {@code fetchBlockToFile} call)
   * @param length the block's length in bytes, as written to the file (may exceed 2 GiB)
   */
  default void onFile(int index, long length) {
    onFailure(index, "other", "unexpected file result (" + length + " bytes) for a fetch into memory");
  }
}
